"""A distributed channel across three network namespaces joined by veth pairs to a bridge: a
replica in each, a producer and a consumer in each (``ip netns exec``).  Locality is asserted from
the replicas' stats (bytes held per replica) and the veth byte counters.  Needs root; skipped with
the reason otherwise.  Helpers: ``docs/examples/netns_bench.py`` (also the benchmark)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


@pytest.fixture(scope="module")
def nets():
    from netns_bench import Namespaces

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    probe = f"zcd{os.getpid()}probe"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        pytest.skip("'ip netns add' is not permitted here")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    ns = Namespaces(prefix=f"zcd{os.getpid()}")
    try:
        ns.open()
    except Exception as exc:
        ns.close()
        pytest.skip(f"could not build the namespaces: {exc}")
    try:
        yield ns
    finally:
        ns.close()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert ns.prefix not in left, "namespaces left behind"
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert ns.prefix not in links, "veths or bridge left behind"


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="zcdn-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_each_key_stays_in_its_namespace(nets, workdir):
    from netns_bench import run_workload

    r = run_workload(nets, workdir, "distributed", 16 * MIB, tensor_bytes=MIB,
                     concurrent=False, check_held=True, numpy_arrays=True)
    # consumers checked every item (exit status 0); each replica holds its own producer's 16 MiB
    for ns in nets.names:
        assert 16 * MIB <= r["held_per_broker"][ns] < 16 * MIB + 64 * 1024, r
    # only control traffic (binding requests to replica 0, heartbeats) crossed namespaces
    assert r["crossing_bytes"] < MIB // 2, r


def test_without_locality_payloads_cross(nets, workdir):
    from netns_bench import run_workload

    r = run_workload(nets, workdir, "replica0", 16 * MIB, tensor_bytes=MIB,
                     concurrent=False, check_held=True, numpy_arrays=True)
    held = r["held_per_broker"]
    assert held[nets.names[0]] >= 48 * MIB and held[nets.names[1]] == held[nets.names[2]] == 0
    # namespaces 1 and 2 send their puts to namespace 0 and their gets come back: 4 x 16 MiB
    assert r["crossing_bytes"] >= 64 * MIB, r
