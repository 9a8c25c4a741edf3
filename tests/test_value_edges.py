"""Values at the edges of what travels (docs/values.md, docs/shm.md): refused alike at the put on
every path, broker (shared memory and frames) and ``local=True``; and the limits of the
same-host pool (``max_message_bytes``, ``shm_pool_bytes``).  Real brokers, real sockets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import wait_until
from zchannel.broker import Channel, serializable
from zchannel.broker.shm.segment import USED

pytestmark = pytest.mark.timeout(90)

T = 64 * 1024  # shared-memory threshold of these tests' brokers: small slots


@serializable
@dataclasses.dataclass
class Prompt:
    """A dataclass whose ``__post_init__`` is not idempotent (prepends a BOS token)."""

    tokens: list

    def __post_init__(self) -> None:
        self.tokens = [0, *self.tokens]


@pytest.fixture
def paths(channels) -> list[tuple[str, Channel]]:
    """One channel per path: a broker's same-host handle (shared memory), a frames handle
    (``shm=False``) on the same broker, and a local channel."""
    owner = Channel.create("edges", shm_threshold=T)
    channels.append(owner)
    frames = Channel.connect("edges", shm=False)
    channels.append(frames)
    local = Channel.create("edges-local", local=True)
    channels.append(local)
    return [("shm", owner), ("frames", frames), ("local", local)]


def _used_slots(ch: Channel) -> int:
    pool = ch._connection().shm.pool
    return sum(int((seg.states == USED).sum()) for seg in pool.by_name.values())


def test_rank_above_the_decoders_limit_is_a_type_error_at_put_on_every_path(paths):
    """Decoders accept rank <= 32: a put of more dimensions is refused at once, on every path
    (never an item that every get then fails on), and stores nothing."""
    big = np.zeros((2,) + (1,) * 32 + (T,), np.uint8)  # rank 34, over the threshold
    for label, ch in paths:
        for item in (np.zeros((1,) * 33), {"obs": big}, torch.zeros((1,) * 33)):
            with pytest.raises(TypeError, match=r"rank 3[34]: at most 32"):
                ch.put(item, timeout=10)
        assert ch.qsize() == 0, label
        ch.put(np.zeros((1,) * 32), timeout=10)  # the limit itself travels
        assert ch.get(timeout=10).ndim == 32
    with pytest.raises(TypeError, match="rank 33"):
        paths[0][1].empty_shm((1,) * 32 + (T,), np.uint8)
    assert _used_slots(paths[0][1]) == 0  # a slot taken for the refused item went back


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_is_the_dense_tensor_type_error_on_every_path(paths):
    """A nested tensor (strided layout, no single shape) is refused like any non-strided one."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    for label, ch in paths:
        with pytest.raises(TypeError, match="nested tensor; convert it to a dense tensor"):
            ch.put({"obs": nested}, timeout=10)
        assert ch.qsize() == 0, label


def test_tensor_shape_numpy_cannot_hold_is_refused_alike_on_every_path(paths):
    """An empty tensor whose other dimensions times its item size pass numpy's largest size
    cannot be made by a receiver: refused at the put, naming the shape, on every path; one
    numpy can hold travels."""
    for _label, ch in paths:
        with pytest.raises(TypeError, match=r"shape \(0, 4611686018427387904\)"):
            ch.put(torch.empty((0, 2**62)), timeout=10)
        ch.put(torch.empty((0, 2**62), dtype=torch.uint8), timeout=10)
        assert ch.get(timeout=10).shape == (0, 2**62)


def test_conjugate_and_negative_bits_are_resolved_on_every_path(paths):
    """A tensor with a lazy conjugate or negative bit arrives with its values resolved on every
    path (``.numpy()`` works), ``local=True`` included."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for label, ch in paths:
        for sent in (z.conj(), z.conj().imag):  # (the imaginary part of a conj view: neg bit)
            expected = sent.resolve_conj().resolve_neg().clone()
            ch.put({"t": sent}, timeout=10)
            got = ch.get(timeout=10)["t"]
            assert not got.is_conj() and not got.is_neg(), label
            np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_post_init_runs_again_on_receipt_on_broker_paths_only(paths):
    """A broker path rebuilds a registered dataclass with its constructor, so ``__post_init__``
    runs again on receipt (docs/values.md: keep it idempotent); ``local=True`` delivers the
    very object that was put, its ``__post_init__`` not run again."""
    for label, ch in paths:
        sent = Prompt([5, 6])
        assert sent.tokens == [0, 5, 6]
        ch.put(sent, timeout=10)
        got = ch.get(timeout=10)
        if label == "local":
            assert got is sent and got.tokens == [0, 5, 6]
        else:
            assert got.tokens == [0, 0, 5, 6], label


def test_empty_shm_refuses_the_dtypes_no_put_accepts(paths):
    """``empty_shm`` checks its dtype as the encoder does: what no put accepts is a
    ``TypeError`` at ``empty_shm``, never a slot (or a tensor) that cannot be put."""
    refused = ["U4", "datetime64[s]", [("a", "<i4"), ("b", "<f4")], np.longdouble, "V8", object,
               torch.qint8]
    for _label, ch in paths:
        for dtype in refused:
            with pytest.raises(TypeError, match="cannot be sent"):
                ch.empty_shm((2 * T,), dtype)
        for dtype in (np.float32, ">f4", torch.bfloat16):
            arr = ch.empty_shm((2 * T,), dtype)
            arr[:] = 1
            ch.put(arr, timeout=10)
            assert ch.get(timeout=10).shape == (2 * T,)
            del arr
    # (a consumer's release of a slot rides with its next message: the broker's answer)
    assert wait_until(lambda: _used_slots(paths[0][1]) == 0, timeout=30)


def test_max_message_bytes_counts_shared_memory_slots(cli_broker, channels):
    """A same-host put whose array would go through a slot is refused over
    ``max_message_bytes`` as a frames put is (a consumer on another host receives the slot's
    bytes as a frame), before anything is copied into a slot."""
    address = cli_broker("capped", "--shm-threshold", str(T), "--max-message-bytes", str(4 * T))
    ch = Channel.connect(address)
    channels.append(ch)
    item = np.zeros(8 * T, np.uint8)
    for handle in (ch, Channel.connect(address, shm=False)):
        channels.append(handle)
        with pytest.raises(ValueError, match="max_message_bytes"):
            handle.put(item, timeout=10)
    pool = ch._connection().shm.pool
    assert pool is not None and not pool.by_name  # refused before a slot was taken
    assert _used_slots(ch) == 0 and ch.qsize() == 0
    ch.put(np.ones(2 * T, np.uint8), timeout=10)  # under the limit, through a slot
    assert ch.get(timeout=10).sum() == 2 * T


def test_pool_budget_of_zero_turns_shared_memory_off(cli_broker, channels):
    """``shm_pool_bytes = 0``: the broker's offer says 0 and no client makes a pool; large
    items go as frames and ``empty_shm`` gives plain arrays."""
    address = cli_broker("nopool", "--shm-threshold", str(T), config="[channel]\nshm_pool_bytes = 0\n")
    ch = Channel.connect(address)
    channels.append(ch)
    assert ch.qsize() == 0  # (the hello is answered)
    assert ch._connection().shm.pool is None
    arr = ch.empty_shm((2 * T,), np.uint8)
    assert arr.base is None  # a plain numpy.empty, no slot
    arr[:] = 3
    ch.put(arr, timeout=10)
    assert ch.get(timeout=10).sum() == 6 * T
    assert ch.stats()["shm"]["slots_in"] == 0


def test_pool_too_small_for_any_slot_falls_back_to_frames_without_waiting(cli_broker, channels):
    """A pool whose budget holds no slot of an item's class has nothing a consumer could free:
    the item goes as a frame at once (no wait for a free slot, nothing learnt from one)."""
    address = cli_broker("tinypool", "--shm-threshold", str(T), config="[channel]\nshm_pool_bytes = 4096\n")
    ch = Channel.connect(address)
    channels.append(ch)
    assert ch.qsize() == 0
    pool = ch._connection().shm.pool
    assert pool is not None and pool.budget == 4096
    for i in range(3):
        ch.put(np.full(2 * T, i, np.uint8), timeout=10)
    assert [int(ch.get(timeout=10)[0]) for _ in range(3)] == [0, 1, 2]
    assert pool.fallbacks == 3 and not pool.by_name
    assert not pool.stalled and not pool.wait_s  # no wait for a freed slot was made
