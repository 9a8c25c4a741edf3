"""The transport seam (broker/transport/seam.py): a ZeroMQ DEALER socket and a same-host direct link
(broker/transport/direct.py) behind one interface, each speaking to a real broker over real sockets."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from zchannel.broker.connection.connection import open_transport
from zchannel.broker.transport.direct import Link
from zchannel.broker.transport.seam import Transport, ZmqTransport
from zchannel.broker.wire.protocol import GET, HELLO, PROTOCOL_VERSION, PUT, pack_header

pytestmark = pytest.mark.timeout(60)


def _reply(transport, rid: int, timeout: float = 10.0) -> tuple[dict, list]:
    """The reply record of request ``rid`` and its frames (heartbeats skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no reply to request {rid} in time"
        # what the connection's callers and I/O thread wait on: ``readable``, then ``recv``
        ready = zmq.zmq_poll([(transport.readable, zmq.POLLIN)], int(remaining * 1000) + 1)
        message = transport.recv(ready=bool(ready)) if ready else None
        if message is None:
            continue
        header, frames = message
        pos = 0
        for rec in msgpack.unpackb(header, raw=False):
            nf = rec.get("nf", 0)
            if rec.get("id") == rid:
                return rec, frames[pos : pos + nf]
            pos += nf


@pytest.mark.parametrize("kind", ["zmq", "direct"])
def test_both_transports_carry_the_same_records_and_frames(make_remote, kind):
    ch = make_remote(f"seam-{kind}")
    address = ch.stats()["address"]
    transport = open_transport(address, None, stall_s=3.0, direct_ok=kind == "direct")
    try:
        assert isinstance(transport, Transport)
        assert isinstance(transport, Link if kind == "direct" else ZmqTransport)
        assert transport.callers_read is (kind == "direct")  # callers read a link themselves
        assert transport.up and not transport.broker_gone()
        transport.send([pack_header([{"op": HELLO, "id": 1, "v": PROTOCOL_VERSION}])])
        hello, _ = _reply(transport, 1)
        assert hello["r"]["name"] == f"seam-{kind}"
        body = bytes(range(256)) * 4  # larger than an inline body: it travels as a frame
        transport.send([pack_header([{"op": PUT, "id": 2, "k": "seam", "nf": 1}]), body])
        assert _reply(transport, 2)[0].get("e") is None
        transport.send([pack_header([{"op": GET, "id": 3, "k": "seam", "t": 5.0}])])
        rec, frames = _reply(transport, 3)
        assert "e" not in rec and [bytes(f) for f in frames] == [body]
    finally:
        transport.close()
        transport.close()  # idempotent
    assert not (kind == "direct" and transport.up)

