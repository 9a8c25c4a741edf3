"""``Channel.create`` on Ray, at its edges: placement-target actors that are dead or that Ray
cannot place, ``address=``, the creator's run directory (unused on Ray), and a worker group's
``shutdown()`` of workers that created channels.  On the shared simulated three-node Ray cluster
(tests/conftest.py ``ray_cluster``); skipped when ray is not installed."""

from __future__ import annotations

import logging
import os
import time

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'zchannel[ray]')")

from conftest import pid_alive, wait_until  # noqa: E402
from zchannel.broker import BrokerStartError, Channel  # noqa: E402
from zchannel.broker.handle import ray_placement  # noqa: E402
from zchannel.broker.shm.segment import list_segments, run_prefix  # noqa: E402
from zchannel.embodied.groups import Worker, WorkerError  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@ray.remote(num_cpus=0)
class Pinger:
    def ping(self) -> int:
        return 1


class ChannelOwner(Worker):
    """A worker that creates its channel (RLinf's ``self.create_channel`` in ``__init__``)."""

    def __init__(self, channel_name: str) -> None:
        self.channel = self.create_channel(channel_name)

    def round_trip(self, value: int) -> int:
        self.channel.put(value, key="k", timeout=30)
        return self.channel.get("k", timeout=30)


class Napper(Worker):
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


def _actor_state(actor) -> object:
    """The state Ray's actor table gives ``actor`` (Ray reports a kill there, asynchronously)."""
    import ray._private.state as state

    return (state.actors(actor_id=actor._actor_id.hex()) or {}).get("State")


def _named_actor_exists(name: str) -> bool:
    return ray_placement.ACTOR_PREFIX + name in ray.util.list_named_actors()


def _create_expecting(exc_type: type, name: str, **kwargs):
    """The ``exc_type`` error ``Channel.create(name, **kwargs)`` raises (a channel it made
    anyway is shut down before the test fails)."""
    try:
        made = Channel.create(name, **kwargs)
    except exc_type as exc:
        return exc
    made.shutdown()
    pytest.fail(f"Channel.create({name!r}, {kwargs}) made a channel instead of raising "
                f"{exc_type.__name__}")


@pytest.mark.parametrize("given_as", ["producers", "consumers"])
def test_a_dead_placement_actor_is_a_value_error_naming_it(ray_cluster, given_as):
    """A placement target that Ray killed is a ``ValueError`` naming the actor, that it is
    dead and the argument that gave it (not Ray's ``ActorDiedError``); nothing is placed."""
    actor = Pinger.remote()
    assert ray.get(actor.ping.remote(), timeout=60) == 1
    ray.kill(actor, no_restart=True)
    assert wait_until(lambda: _actor_state(actor) in ("DEAD", 4), timeout=60), _actor_state(actor)
    exc = _create_expecting(ValueError, "rfdead", **{given_as: [actor]})
    message = str(exc)
    assert f"channel 'rfdead': the actor {actor._actor_id.hex()} given in {given_as}=" in message
    assert "is dead or cannot be placed" in message and "ActorDiedError" in message
    assert not _named_actor_exists("rfdead")


def test_an_actor_ray_cannot_place_is_logged_then_a_broker_start_error(ray_cluster, caplog,
                                                                       monkeypatch):
    """A placement target Ray cannot place (it asks for a resource no node has) makes
    ``create`` log that it waits, then raise ``BrokerStartError`` (reason ``Timeout``) naming
    the actor and the start timeout (shortened here), not Ray's ``GetTimeoutError``."""
    monkeypatch.setattr(ray_placement, "START_TIMEOUT_S", 3.0)
    monkeypatch.setattr(ray_placement, "PLACEMENT_NOTICE_S", 0.2, raising=False)
    actor = Pinger.options(resources={"rf_no_node_has_this": 1}).remote()
    try:
        with caplog.at_level(logging.WARNING, logger="zchannel.client"):
            exc = _create_expecting(BrokerStartError, "rfpending", consumers=[actor])
    finally:
        ray.kill(actor, no_restart=True)
    assert exc.reason == "Timeout", exc.reason
    message = str(exc)
    assert f"the actor {actor._actor_id.hex()} given in consumers=" in message
    assert "was not placed on a node by Ray within the start timeout of 3 s" in message
    assert "is not placed on a node yet" in caplog.text, caplog.text
    assert not _named_actor_exists("rfpending")


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "ipc:///tmp/rf-refused.sock"])
def test_an_address_on_ray_is_refused(ray_cluster, distributed, address):
    """On Ray each broker's address is chosen on its node: ``address=`` is a ``ValueError``
    saying so (it was dropped without a word), and nothing is placed."""
    exc = _create_expecting(ValueError, "rfaddr", distributed=distributed, address=address)
    assert f"address={address!r} cannot be used on Ray" in str(exc)
    assert "chosen on that node" in str(exc)
    assert not _named_actor_exists("rfaddr")


def test_create_on_ray_does_not_use_the_creators_run_directory(ray_cluster, tmp_path,
                                                               monkeypatch):
    """A Ray-placed channel keeps its files in its actors' work directories: a creator whose
    run directory zchannel would refuse (mode 0755) creates and uses it, and nothing is
    written to that directory."""
    unsafe = tmp_path / "open-run-dir"
    unsafe.mkdir()
    unsafe.chmod(0o755)
    monkeypatch.setenv("ZCHANNEL_RUN_DIR", str(unsafe))
    ch = Channel.create("rfrundir")
    try:
        ch.put(5, key="k")
        assert ch.get("k", timeout=30) == 5
    finally:
        ch.shutdown()
    assert os.listdir(unsafe) == []


def test_group_shutdown_gives_back_what_its_workers_channels_took(ray_cluster):
    """``WorkerGroup.shutdown()`` of a Ray group whose worker created a channel tears that
    channel down before it kills the worker: the broker actor is gone, its broker process
    stopped, and its work directory (CURVE secret keys, token, lock) and shared memory are
    removed."""
    group = ChannelOwner.create_group("rfowned").launch(1, name="owner", ray=True)
    try:
        assert group.round_trip(7).wait(timeout=60) == [7]
        broker_actor = ray.get_actor(ray_placement.ACTOR_PREFIX + "rfowned")
        broker_pid = ray.get(broker_actor.pid.remote(), timeout=60)
        workdir = ray_placement.work_dir(broker_actor._actor_id.hex())
        assert broker_pid > 0 and os.path.isdir(workdir)
    finally:
        group.shutdown(timeout=60)
    assert not os.path.exists(workdir), sorted(
        os.path.relpath(os.path.join(r, f), workdir) for r, _, fs in os.walk(workdir) for f in fs)
    assert list_segments(run_prefix(os.path.join(workdir, "run"))) == []
    assert not pid_alive(broker_pid), f"broker {broker_pid} outlived its worker group"
    assert not _named_actor_exists("rfowned")


def test_group_shutdown_kills_a_rank_busy_in_a_call_after_its_timeout(ray_cluster, caplog):
    """A rank busy in a call cannot tear down its channels: ``shutdown(timeout=...)`` kills
    it once the timeout passed (it does not wait for the call), with a warning naming it."""
    group = Napper.create_group().launch(1, name="napper", ray=True)
    actor = group._actors[0]
    napping = group.nap(600)
    with caplog.at_level(logging.WARNING, logger="zchannel.embodied"):
        group.shutdown(timeout=1.0)
    assert "worker group 'napper': ranks [0] did not answer within 1 s" in caplog.text, caplog.text
    with pytest.raises(WorkerError, match="napper:0 failed"):
        napping.wait(timeout=60)
    assert wait_until(lambda: _actor_state(actor) in ("DEAD", 4), timeout=60), _actor_state(actor)
