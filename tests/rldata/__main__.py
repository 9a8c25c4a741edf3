"""Runs a program when imported: ``register_module(..., recursive=True)`` must skip it."""

raise SystemExit("rldata.__main__ was imported")
