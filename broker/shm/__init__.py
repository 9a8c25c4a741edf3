"""Same-host shared memory for large arrays and tensors (``docs/shm.md``).

When a client and its broker share a host, arrays and tensors of at least ``shm_threshold``
bytes travel in a slot of a preallocated, reused shared-memory segment, and only a slot
reference goes through the broker; everything else about an item is unchanged.  By
responsibility:

- ``segment``: the segment files every side maps (layout, names, the path's two records);
- ``pool``: the producer's segments and slots (copying into a slot, or lending one to write in);
- ``client``: a connection's side (same-host proof, its pool, mapping and decoding the slots it
  receives, releasing them);
- ``broker``: the broker's side (the probe, holds, byte accounting, slots as frames for other
  hosts, cleanup);
- ``claims``: which client a producer's segment belongs to (the pid in its name), and a put's
  slot references checked before the broker records anything.

The names below are re-exported for users and tests; the package's own modules import from
the module that defines a name.
"""

from zchannel.broker.shm.broker import ShmBroker
from zchannel.broker.shm.client import ShmClient, env_enabled
from zchannel.broker.shm.pool import (
    CLASS_BYTES,
    FIRST_SEGMENT_BYTES,
    MIN_CLASS_SLOTS,
    Pool,
    check_reserve,
)
from zchannel.broker.shm.segment import (
    DEFAULT_POOL_BYTES,
    DEFAULT_THRESHOLD,
    FREE,
    MAX_SLOTS,
    SHM_DIR,
    USED,
    Segment,
    list_segments,
    prefix_for,
    run_prefix,
)

__all__ = [
    "CLASS_BYTES",
    "DEFAULT_POOL_BYTES",
    "DEFAULT_THRESHOLD",
    "FIRST_SEGMENT_BYTES",
    "FREE",
    "MAX_SLOTS",
    "MIN_CLASS_SLOTS",
    "SHM_DIR",
    "USED",
    "Pool",
    "Segment",
    "ShmBroker",
    "ShmClient",
    "check_reserve",
    "env_enabled",
    "list_segments",
    "prefix_for",
    "run_prefix",
]
