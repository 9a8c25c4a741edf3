"""Tensor devices and item sizes on the put and decode paths (docs/values.md, docs/shm.md):
a broker whose hooks decode items keeps their tensors on the CPU, as views of their frames and
slots, and sends them on with the device their producer sent; a receiver that cannot move a
tensor to its device gets it on the CPU instead of losing the item; a put over
``max_message_bytes`` is refused before anything is taken from the shared-memory pool.

There is no GPU here: a tensor "sent from cuda:0" is a wire record naming that device, and a
receiver whose move fails is one where ``torch.cuda.is_available()`` says True while no
device can be used (this torch build finds no driver then, as a child forked after its parent
used CUDA finds CUDA unusable)."""

from __future__ import annotations

import dataclasses
import logging
import os

import msgpack
import numpy as np
import pytest
import torch
import zmq
from zchannel.broker import Channel, serializable
from zchannel.broker.core.state import Item
from zchannel.broker.server import loop
from zchannel.broker.shm.broker import FramedSlots, ShmBroker
from zchannel.broker.shm.segment import SHM_DIR, list_segments
from zchannel.broker.wire import arrays, codec
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, pack_header

pytestmark = pytest.mark.timeout(120)

T = 64 * 1024  # shared-memory threshold of these tests' brokers
LIMIT = 256 * 1024  # their max_message_bytes (the least a broker takes)
N = 20_000  # float32 elements of the tensors sent "from cuda:0": 80 KB, a frame of their own


def _tensor_body(device: str, loc: object, n: int = N) -> bytes:
    """The body of an item ``{"v": tensor}`` whose float32 tensor of ``n`` elements, at
    ``loc``, was sent from ``device`` (what a producer on that device sends)."""
    payload = msgpack.packb(["float32", [n], loc, device])
    return msgpack.packb({"v": msgpack.ExtType(3, payload)})


def _devices_in(body: bytes) -> list[str]:
    """The device fields of the tensor descriptors in an item's body, read with msgpack
    alone."""
    found: list[str] = []

    def ext_hook(code: int, data: bytes) -> object:
        if code == 3:
            found.append(msgpack.unpackb(data, raw=False)[3])
        elif code in (1, 4, 7, 8):  # tuples, dataclasses, sets: nested values
            msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)
        return None

    msgpack.unpackb(body, ext_hook=ext_hook, raw=False, strict_map_key=False)
    return found


@pytest.fixture
def cuda_says_available(monkeypatch):
    """This process's ``torch.cuda.is_available()`` says True, though no device can be used;
    its warning of a tensor left on the CPU not given yet."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(arrays, "_warned_pid", 0, raising=False)  # (a process of its own)


def _data() -> np.ndarray:
    return np.arange(N, dtype=np.float32)


# -- a broker whose hooks decode items -------------------------------------------------------


def test_a_decoding_broker_keeps_tensors_on_the_cpu_as_views_and_sends_their_device_on(
        cuda_says_available):
    """The decode a broker's hooks get (``server/loop.py``) moves no tensor to a device, even
    where CUDA says it is available: the tensor is a view of its frame, and an output holding
    it is encoded with the device its producer sent."""
    frame = bytearray(_data().tobytes())
    item = Item([zmq.Frame(_tensor_body("cuda:0", 0)), frame], 1, 0)
    value = loop._decode_item(item)
    tensor = value["v"]
    assert tensor.device.type == "cpu" and torch.equal(tensor, torch.from_numpy(_data()))
    tensor[0] = -1  # a view of the frame, not a copy
    assert np.frombuffer(frame, np.float32)[0] == -1
    out = loop._encode_item({"w": tensor, "again": [tensor]}, 1)
    assert _devices_in(out.payload[0].bytes) == ["cuda:0", "cuda:0"]
    # an inline tensor (under 64 KiB) keeps its device too
    small = Item([zmq.Frame(_tensor_body("cuda:1", np.ones(4, np.float32).tobytes(), 4))], 1, 0)
    kept = loop._decode_item(small)["v"]
    assert kept.device.type == "cpu" and kept.tolist() == [1, 1, 1, 1]
    assert _devices_in(loop._encode_item(kept, 1).payload[0].bytes) == ["cuda:1"]


def test_a_decoding_broker_keeps_slot_tensors_on_the_cpu_and_sends_their_device_on(
        run_dir, cuda_says_available):
    """The same for an item whose tensor is in a slot (``ShmBroker.decode_item``, here one
    read back from a journal, its slot's bytes a frame): a view of the slot's bytes, re-encoded
    with its producer's device."""
    shm = ShmBroker("devices", run_dir, threshold=0)
    slot = bytearray(_data().tobytes())
    payload = FramedSlots([zmq.Frame(_tensor_body("cuda:0", [0])), slot], framed=[1])
    decode = shm.decode_item(lambda item: pytest.fail("not a slot item"))
    tensor = decode(Item(payload, 1, 0))["v"]
    assert tensor.device.type == "cpu" and torch.equal(tensor, torch.from_numpy(_data()))
    tensor[1] = -2
    assert np.frombuffer(slot, np.float32)[1] == -2
    assert _devices_in(loop._encode_item(tensor, 1).payload[0].bytes) == ["cuda:0"]


def test_a_tensor_made_by_a_hook_travels_with_its_own_device():
    """Only the decoded tensor itself carries its producer's device: a new tensor made from it
    (a slice, a copy) is the CPU tensor it is, and a plain CPU tensor says "cpu"."""
    item = Item([zmq.Frame(_tensor_body("cuda:0", 0)), _data().tobytes()], 1, 0)
    tensor = loop._decode_item(item)["v"]
    made = [tensor[:10], tensor.clone(), torch.ones(3)]
    assert _devices_in(loop._encode_item(made, 1).payload[0].bytes) == ["cpu"] * 3


def _raw_dealer(address: str) -> zmq.Socket:
    """A bare DEALER that said hello to the broker at ``address`` (it never proves it shares
    the host: items come to it as frames)."""
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    raw.send_multipart([pack_header([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])])
    assert raw.poll(30_000), "no hello reply"
    raw.recv_multipart()
    return raw


def _raw_reply(raw: zmq.Socket, rid: int) -> tuple[dict, list[bytes]]:
    """The reply record to request ``rid`` and the frames after its header."""
    while True:
        assert raw.poll(30_000), f"no reply to request {rid}"
        header, *frames = raw.recv_multipart()
        for rec in msgpack.unpackb(header, raw=False, strict_map_key=False):
            if rec.get("id") == rid:
                assert "e" not in rec, rec
                return rec, frames


def _raw_put(raw: zmq.Socket, rid: int, body: bytes, *buffers: bytes) -> None:
    raw.send_multipart([pack_header([{"op": "put", "id": rid, "k": "default_queue",
                                      "nf": 1 + len(buffers)}]), body, *buffers])
    _raw_reply(raw, rid)


def _raw_get_devices(raw: zmq.Socket, rid: int) -> list[str]:
    """The devices of the tensors of the item a get from ``raw`` receives, as sent."""
    raw.send_multipart([pack_header([{"op": "get", "id": rid, "k": "default_queue", "t": 30}])])
    rec, frames = _raw_reply(raw, rid)
    body = rec["b"] if "b" in rec else frames[0]
    return _devices_in(body)


@pytest.mark.parametrize("path", ["frames", "shared memory"])
def test_a_collectors_output_reaches_its_consumer_with_the_producers_device(channels, path):
    """End to end: a tensor sent from cuda:0 goes through a broker whose collector decodes every
    put and yields the tensor alone (``payloads.Unwrap``), and its consumer receives it
    tagged cuda:0, as from a broker without hooks.  Through shared memory the producer is a
    same-host client whose tensor is in a slot: a CPU tensor marked as sent from cuda:0, as a
    broker's hooks hold it (what a bare DEALER cannot put)."""
    owner = Channel.create("devices-" + path.split()[0], collector="payloads:Unwrap",
                           shm_threshold=T)
    channels.append(owner)
    raw = _raw_dealer(owner.address)
    try:
        if path == "frames":
            _raw_put(raw, 2, _tensor_body("cuda:0", 0), _data().tobytes())
        else:
            tensor = torch.arange(4 * T, dtype=torch.float32)  # 1 MiB: a slot
            setattr(tensor, arrays.SENT_DEVICE, "cuda:0")
            owner.put({"v": tensor}, timeout=30)
            assert owner.stats()["shm"]["slots_in"] == 1
        assert _raw_get_devices(raw, 3) == ["cuda:0"]
    finally:
        raw.close()


# -- a receiver that cannot move a tensor to its device --------------------------------------


def test_a_receiver_that_cannot_move_a_tensor_to_its_device_gets_it_on_the_cpu(
        channels, caplog, cuda_says_available):
    """A consumer whose ``torch.cuda.is_available()`` is true but whose move to cuda:0 fails
    gets every item, its tensor on the CPU, and one warning naming the device and the error
    (the first time in the process only)."""
    owner = Channel.create("devices-receiver")
    channels.append(owner)
    raw = _raw_dealer(owner.address)
    try:
        for rid in (2, 3):
            _raw_put(raw, rid, _tensor_body("cuda:0", 0), _data().tobytes())
    finally:
        raw.close()
    with caplog.at_level(logging.WARNING, logger="zchannel.client"):
        got = [owner.get(timeout=30)["v"] for _ in range(2)]
    for tensor in got:
        assert tensor.device.type == "cpu" and torch.equal(tensor, torch.from_numpy(_data()))
    warnings = [r.getMessage() for r in caplog.records if "stays on the CPU" in r.getMessage()]
    assert len(warnings) == 1 and "cuda:0" in warnings[0], warnings
    assert owner.qsize() == 0


def test_restore_device_names_the_exact_device_and_leaves_the_rest_on_the_cpu():
    """A device of a kind this process does not have leaves the tensor on the CPU (no
    warning); a malformed device name is a ``ValueError``."""
    tensor = torch.ones(2)
    assert arrays.restore_device(tensor, "cpu") is tensor
    assert arrays.restore_device(tensor, "cpu:0") is tensor
    assert arrays.restore_device(tensor, "nosuchkind:0") is tensor
    if not torch.cuda.is_available():
        assert arrays.restore_device(tensor, "cuda:3") is tensor
    for bad in (3, None, "x" * 33):
        with pytest.raises(ValueError, match="malformed tensor device"):
            arrays.restore_device(tensor, bad)


# -- max_message_bytes before the pool ------------------------------------------------------


def _segments_of(ch: Channel) -> list[str]:
    """The channel's segments in ``/dev/shm`` other than its probe."""
    shm = ch.stats()["shm"]
    return [name for name in list_segments(shm["prefix"]) if "probe" not in name
            and os.path.exists(os.path.join(SHM_DIR, name))]


@pytest.mark.parametrize("item", [
    pytest.param(lambda: np.ones(4 << 20, np.uint8), id="one array"),
    pytest.param(lambda: {"a": torch.ones(40_000), "b": np.ones((400, 400))[:, ::2]},
                 id="arrays each under the limit"),
])
def test_a_put_over_max_message_bytes_takes_no_shared_memory(cli_broker, channels, item):
    """A same-host put refused for ``max_message_bytes`` is refused before its arrays are
    copied into slots: the pool makes no segment (the size class of a large array would be
    made and faulted in), and a put under the limit still goes through a slot."""
    address = cli_broker("capped-devices", "--shm-threshold", str(T),
                         "--max-message-bytes", str(LIMIT))
    ch = Channel.connect(address)
    channels.append(ch)
    assert ch.qsize() == 0  # (the hello is answered)
    pool = ch._connection().shm.pool
    assert pool is not None
    value = item()
    with pytest.raises(ValueError, match=rf"^item of \d+ bytes exceeds the broker's "
                                         rf"max_message_bytes limit \({LIMIT}\)$") as refused:
        ch.put(value, timeout=30)
    assert pool.total == 0 and not pool.by_name and _segments_of(ch) == []
    total = int(str(refused.value).split()[2])
    assert total == codec.encoded_bytes(value, T) > LIMIT
    ch.put(np.ones(2 * T, np.uint8), timeout=30)  # under the limit, through a slot
    assert pool.by_name and ch.get(timeout=30).sum() == 2 * T


@serializable
@dataclasses.dataclass
class _Sized:
    """A registered dataclass holding arrays (sizes through nesting ext types)."""

    a: object
    b: object = None


class _Slots:
    """A slot allocator that takes every array of at least ``threshold`` bytes (what a pool
    with free slots does), for ``codec.encode_shm``."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def __call__(self, data: object, nbytes: int) -> list | None:
        return ["segment", 0, nbytes] if nbytes >= self.threshold else None

    def undo(self, refs: list) -> None:
        pass


_BIG = np.arange(300_000, dtype=np.float32)


@pytest.mark.parametrize("value", [
    _BIG, _BIG[::2], _BIG.reshape(600, 500).T, np.float32(3), np.zeros((), np.int8),
    torch.arange(100_000), torch.arange(100_000.0).reshape(1000, 100).T,
    torch.zeros(70_000, dtype=torch.bfloat16), torch.ones(20_000).conj(),
    torch.ones(4, requires_grad=True),
    {"a": _BIG, "b": [torch.ones(5), (1, 2, {3})], "c": b"x" * 70_000},
    _Sized(_BIG, (torch.ones(20_000), frozenset({1}))), [memoryview(b"y" * 100_000)],
    memoryview(b"z" * 100_000)[::2], (_BIG,) * 3, [1] * 1000, {"k": bytearray(70_000)},
    b"q" * 70_000, "s", 2**70, torch.Size([2, 3]), [_BIG[:16384], _BIG[:16383], _BIG[:16385]],
], ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("threshold", [0, T, 1 << 20])
def test_encoded_bytes_is_what_the_encoding_takes(value, threshold):
    """``codec.encoded_bytes``: the body, buffers and slots of the encoding, counted without
    taking any array's data, with every array of at least ``threshold`` bytes in a slot."""
    if threshold:
        body, buffers, refs = codec.encode_shm(value, _Slots(threshold))
    else:
        (body, buffers), refs = codec.encode(value), []
    taken = len(body) + sum(memoryview(b).nbytes for b in buffers) + sum(r[2] for r in refs)
    assert codec.encoded_bytes(value, threshold) == taken
