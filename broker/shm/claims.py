"""Which client a producer's shared-memory segment belongs to, and the slot references of a put
checked against that before the broker records anything (``ShmBroker.attach_put``).

A segment's name carries the pid of the process that made it (``<prefix><pid>-<hex>``,
``Segment.create``).  A put may name the slots of a segment the broker has not recorded yet
only if its client gave that pid in its ``shm_hi``; a client that gave none (an older client)
owns the first segment it names.  Once recorded, a segment is its owner's: another client's
reference to it is refused.  Every reference of a put is checked before any is taken, so a
refused put records no segment and takes no slot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from zchannel.broker.shm.segment import USED, Segment
from zchannel.broker.wire.protocol import MAX_SLOT_REFS as MAX_REFS  # slot references in one put

_CREATOR_RE = re.compile(r"^([0-9]+)-[0-9a-f]+\Z")  # what a segment's name holds after its prefix


def creator_pid(prefix: str, name: str) -> int | None:
    """The pid of the process that made segment ``name`` of ``prefix`` (None for a name that
    holds none, such as the probe's)."""
    m = _CREATOR_RE.match(name[len(prefix):])
    return int(m.group(1)) if m else None


class BrokerSegment:
    """A producer's segment the broker mapped: its owner (None once that client left), the
    owner's routing id, and the references the broker holds to each slot."""

    __slots__ = ("seg", "owner", "addr", "refs", "orphan", "orphan_at")

    def __init__(self, seg: Segment, owner: Any) -> None:
        self.seg, self.owner, self.refs, self.orphan = seg, owner, [0] * seg.nslots, False
        self.addr = owner.address  # the owner's routing id (kept across its reconnects)
        self.orphan_at = 0.0


@dataclass(slots=True)
class CheckedRefs:
    """A put's slot references, checked: the ones that checked out as ``(segment, slot,
    nbytes)``, the segments first named by them (not recorded yet), and the first refusal."""

    slots: list[tuple[BrokerSegment, int, int]] = field(default_factory=list)
    opened: dict[str, BrokerSegment] = field(default_factory=dict)
    error: ValueError | None = None


def check_refs(refs: Any, client: Any, pid: int | None, segments: dict[str, BrokerSegment],
               prefix: str, probe: str | None) -> CheckedRefs:
    """The slot references ``refs`` of a put of ``client`` (which gave ``pid``, or None),
    each checked against the recorded ``segments`` of channel ``prefix``; changes nothing.
    ``ValueError`` for a list that is not one of references."""
    if not isinstance(refs, list) or not refs or len(refs) > MAX_REFS:
        raise ValueError("malformed shared-memory slot list")
    checked = CheckedRefs()
    taken: set[tuple[str, int]] = set()
    for ref in refs:
        try:
            bseg, slot, nbytes = _check_ref(ref, client, pid, segments, checked.opened, prefix,
                                            probe)
            if (bseg.seg.name, slot) in taken:
                raise ValueError(f"shared-memory slot {slot} of {bseg.seg.name!r} is named "
                                 "twice in one put")
        except ValueError as exc:
            checked.error = checked.error or exc
            continue
        taken.add((bseg.seg.name, slot))
        checked.slots.append((bseg, slot, nbytes))
    return checked


def _check_ref(ref: Any, client: Any, pid: int | None, segments: dict[str, BrokerSegment],
               opened: dict[str, BrokerSegment], prefix: str, probe: str | None
               ) -> tuple[BrokerSegment, int, int]:
    """The segment, slot and byte count of one reference, checked (``ValueError``); a segment
    neither recorded nor in ``opened`` is mapped into ``opened`` as ``client``'s."""
    if not (isinstance(ref, list) and len(ref) == 3):
        raise ValueError("malformed shared-memory slot reference")
    name, slot, nbytes = ref
    if not isinstance(name, str) or not name.startswith(prefix) or name == probe:
        raise ValueError(f"shared-memory segment {name!r} is not one of this channel")
    bseg = segments.get(name)
    if bseg is None:
        bseg = opened.get(name)
    if bseg is None:
        bseg = opened[name] = _open(name, client, pid, prefix)
    if bseg.owner is not client and not (bseg.owner is None and bseg.addr == client.address):
        raise ValueError(f"shared-memory segment {name!r} belongs to another client")
    seg = bseg.seg
    if (isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < seg.nslots
            or isinstance(nbytes, bool) or not isinstance(nbytes, int)
            or not 0 < nbytes <= seg.slot_size):
        raise ValueError("shared-memory slot reference out of range")
    if seg.states[slot] != USED or bseg.refs[slot]:
        raise ValueError(f"shared-memory slot {slot} of {name!r} is not a fresh slot")
    return bseg, slot, nbytes


def _open(name: str, client: Any, pid: int | None, prefix: str) -> BrokerSegment:
    """Map segment ``name`` as ``client``'s: only one whose name carries ``pid``, the pid the
    client gave (any segment when it gave none)."""
    if pid is not None:
        creator = creator_pid(prefix, name)
        if creator != pid:
            made_by = "no process" if creator is None else f"process {creator}"
            raise ValueError(f"shared-memory segment {name!r} was made by {made_by}, not by "
                             f"this client (process {pid}): a put names only slots of its "
                             "own segments")
    return BrokerSegment(Segment.open(name), client)
