"""An RL framework's data modules as the tests meet them: plain dataclasses and Enums shaped like
RLinf's (``rlinf/data/io_struct.py``, ``rlinf/data/embodied_io_struct.py``), written without any
zchannel decorator.  ``register_module("rldata", recursive=True)`` registers them (tests/payloads.py
does, so every process that imports payloads knows them); this package imports no submodule."""
