"""Arguments that switch a mode (``ack``, ``async_op``, ``peek``'s ``weights``) are True or
False: a truthy ``"no"`` is a ``TypeError`` that changes nothing, not a leased delivery nobody
acknowledges.  Also the fixes the errors name: a numpy integer key (``int(key)``), ``connect``'s
timeout, a ``Work`` done-callback that is not callable.  Broker and local channels alike."""

from __future__ import annotations

import numpy as np
import pytest
from zchannel.broker import Channel


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_mode_flags_must_be_bools(local, channels):
    ch = Channel.create(f"flags-{'local' if local else 'broker'}", local=local)
    channels.append(ch)
    ch.put("x", weight=1)
    calls = {
        "get ack": lambda: ch.get(ack="no", timeout=5),
        "get_nowait ack": lambda: ch.get_nowait(ack=1),
        "put async_op": lambda: ch.put("y", weight=1, async_op="no"),
        "get async_op": lambda: ch.get(async_op="no", timeout=5),
        "get_batch async_op": lambda: ch.get_batch(1, async_op="yes", timeout=5),
        "peek weights": lambda: ch.peek(weights="no"),
    }
    for what, call in calls.items():
        with pytest.raises(TypeError, match="must be True or False"):
            call()
        assert ch.qsize() == 1, what  # nothing taken, nothing stored
    assert ch.stats()["leases"] == 0
    assert ch.peek(weights=np.bool_(True)) == [("x", 1)]  # a numpy bool is a bool
    assert ch.get(ack=np.bool_(False), timeout=5) == "x"


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_the_errors_name_their_fix(local, channels):
    ch = Channel.create(f"argfix-{'local' if local else 'broker'}", local=local)
    channels.append(ch)
    with pytest.raises(TypeError, match=r"int64: pass int\(key\)"):
        ch.put(1, key=np.int64(3))
    with pytest.raises(TypeError, match=r"int32: pass int\(key\)"):
        ch.put(1, key=("env", np.int32(3)))
    work = ch.put(1, weight=1, async_op=True)
    with pytest.raises(TypeError, match="add_done_callback.. takes a callable, not NoneType"):
        work.add_done_callback(None)
    work.wait(10)
    assert ch.get(timeout=5) == 1 and ch.qsize() == 0
    if not local:
        with pytest.raises(ValueError, match="connect needs a timeout.*got nan"):
            Channel.connect(ch.address, timeout=float("nan"))
        with pytest.raises(ValueError, match="connect needs a timeout.*got None"):
            Channel.connect(ch.address, timeout=None)
