"""Ray placement: two creates of one name at once, ``launch(node_ranks=...)`` checked as
``Channel.create(node_rank=...)`` is, and a cluster file given on Ray.  On the shared simulated
three-node Ray cluster (tests/conftest.py ``ray_cluster``); skipped when ray is not installed."""

from __future__ import annotations

import logging
import threading

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'zchannel[ray]')")

from zchannel.broker import Channel, ChannelNotFound  # noqa: E402
from zchannel.broker.handle import ray_placement  # noqa: E402
from zchannel.embodied.groups import Worker  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class Echo(Worker):
    def hi(self) -> str:
        return "hi"


def test_two_creates_of_one_name_at_once_attach(ray_cluster, monkeypatch):
    """Both creates look the name up before either placed it (held at a barrier after their
    first lookup): one places the channel, the other attaches to it, as a second create does."""
    lookup = ray_placement._lookup
    barrier = threading.Barrier(2, timeout=60)
    first_look: set[int] = set()

    def looked_up_together(name: str):
        info = lookup(name)
        if threading.get_ident() not in first_look:
            first_look.add(threading.get_ident())
            barrier.wait()
        return info

    monkeypatch.setattr(ray_placement, "_lookup", looked_up_together)
    results: list = [None, None]

    def create(i: int) -> None:
        try:
            results[i] = Channel.create("rayrace", distributed=True)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=create, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    try:
        assert all(isinstance(r, Channel) for r in results), results
        assert sorted(r.created for r in results) == [False, True], results
        placed = next(r for r in results if r.created)
        attached = next(r for r in results if not r.created)
        attached.put(1, key="k")
        assert placed.get("k", timeout=30) == 1
    finally:
        for r in results:
            if isinstance(r, Channel) and not r.created:
                r.close()
        for r in results:
            if isinstance(r, Channel) and r.created:
                r.shutdown()


@pytest.mark.parametrize("node_ranks", [[3], [], [-1], [0, True]])
def test_launch_checks_node_ranks(ray_cluster, node_ranks):
    """``launch(ray=True, node_ranks=...)`` refuses node ranks the cluster does not have (3 of
    3 nodes, negative, bool) and an empty list with a ``ValueError``, starting nothing."""
    group = Echo.create_group()
    with pytest.raises(ValueError, match="node_ranks"):
        group.launch(2, name="ranks", ray=True, node_ranks=node_ranks)
    assert group.size == 0


def test_cluster_file_on_ray_is_ignored_with_a_warning(ray_cluster, caplog, tmp_path):
    """On Ray, ``options={"cluster": FILE}`` is ignored (Ray places the replicas), and a
    warning says so."""
    path = str(tmp_path / "cluster.toml")
    with caplog.at_level(logging.WARNING, logger="zchannel.client"):
        ch = Channel.create("raycf", options={"cluster": path})
    try:
        assert ch.created
        assert f"the cluster file {path} is ignored" in caplog.text, caplog.text
    finally:
        ch.shutdown()


def test_connect_to_a_name_ray_does_not_know_says_it_looked_on_ray(ray_cluster):
    """With Ray connected, a name neither this host nor Ray serves is ``ChannelNotFound``
    saying both were asked (not only "on this host")."""
    with pytest.raises(ChannelNotFound, match=r"no channel named 'raynone' on this host nor "
                                              r"on Ray \(no actor 'zchannel:raynone'"):
        Channel.connect("raynone", timeout=1)
