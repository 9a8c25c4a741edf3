"""The roster of a channel's consumers (``broker/core/consumers.py``): the present consumers in
``(group, int(rank))`` order as they join and leave, kept sorted as they come — a burst of
thousands of consumers joining once sorted them all at every join (a 2,000-client start-up
stalled a broker for seconds, and its other clients expired)."""

from __future__ import annotations

import random

import zchannel.broker.core.consumers as consumers_module
from zchannel.broker.core.consumers import Consumers
from zchannel.broker.core.state import Client
from zchannel.hooks import consumer_sort_key


def _client(identity: str) -> Client:
    return Client(address=identity.encode(), identity=identity)


def test_present_consumers_stay_in_order_as_they_join_and_leave():
    roster = Consumers(("b:1", "a:10", "a:2"))
    rng = random.Random(7)
    clients = {}
    for _ in range(2000):
        cid = f"{rng.choice(('w', 'x', 'y.z'))}:{rng.randrange(40)}"  # never a declared id
        if cid in clients and rng.random() < 0.5:
            roster.leave(clients.pop(cid))
        elif cid not in clients:
            clients[cid] = _client(cid)
            roster.join(clients[cid])
        expected = set(clients) | {"b:1", "a:10", "a:2"}
        assert roster.present() == tuple(sorted(expected, key=consumer_sort_key))
    declared = _client("a:2")  # a declared consumer that made contact and left: gone
    roster.join(declared)
    roster.leave(declared)
    assert "a:2" not in roster.present() and "a:10" in roster.present()


def test_a_burst_of_joins_does_not_sort_the_roster_at_each_join(monkeypatch):
    """5,000 consumers joining, each followed by ``present()`` (as a dispatcher's context is
    updated at each join): the sort key is computed O(log n) times a join, not n times."""
    calls = 0

    def counted(consumer_id: str) -> tuple[str, int, str]:
        nonlocal calls
        calls += 1
        return consumer_sort_key(consumer_id)

    monkeypatch.setattr(consumers_module, "consumer_sort_key", counted)
    roster = Consumers(())
    n = 5000
    for i in range(n):
        roster.join(_client(f"worker:{i}"))
        assert len(roster.present()) == i + 1
    assert calls < n * 20, calls  # sorting at each join: ~n * n / 2 = 12,500,000
