"""zchannel.configs: the example configuration files, installed with the package.

The TOML files beside this module (``bench_targets.toml``, ``bench_quick.toml``,
``embodied_*.toml``, ``flatten_round_robin.toml``, ``cluster_example.toml``) are package data:
read them with ``importlib.resources.files("zchannel.configs")``.  In a checkout they are the
repository's ``configs/`` folder; ``zchannel broker --config configs/NAME.toml`` (and ``zchannel
bench --config``) find the installed copy when no such file exists where the command runs.
"""
