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


@pytest.fixture(autouse=True)
def _brokers_in_their_namespace(spawned_brokers):
    """Creators inside a namespace start their brokers as children there (a fork server's
    brokers would live in the fork server's namespace)."""


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


CURVE_CLIENT = """
import sys
from zchannel.broker import AuthenticationFailed, Channel, ChannelNotFound
mode, name = sys.argv[1], sys.argv[2]
try:
    ch = Channel.connect(name, timeout=5)  # the replica table comes from $ZCHANNEL_CLUSTER
    ch.stats()  # every replica must answer
except (AuthenticationFailed, ChannelNotFound) as exc:
    print("refused", type(exc).__name__, flush=True)
    sys.exit(0)
if mode == "put":
    ch.put("secret-payload", key="k1")
    print("put", ch.node_of("k1"), flush=True)
else:
    item = ch.get("k1", timeout=30)
    print("got", item, ch.node_of("k1"),
          ",".join(str(r["bound_keys"]) for r in ch.stats()["replicas"]), flush=True)
ch.close()
"""


# starts the replica of its namespace with Channel.create from the cluster file; shuts it down
# when a line arrives on stdin
CREATOR = """
import sys
from zchannel.broker import Channel
ch = Channel.create(sys.argv[1], distributed=True, options={"cluster": sys.argv[2]})
print("ready", ch.created, flush=True)
sys.stdin.readline()
ch.shutdown()
"""


@pytest.mark.parametrize("start", ["cli", "create"])
def test_cluster_file_curve(nets, workdir, start):
    """CURVE from a cluster file on non-loopback addresses: ``zchannel keygen --replicas 3``
    writes the keys; replicas start with their own key pairs (``zchannel broker --cluster``, or
    ``Channel.create`` in each namespace) and admit only the listed keys; a client without keys,
    and one with a key pair that is not listed, are refused; one with the client key pair works,
    and the replicas replicate the binding table to each other (every replica holds the
    binding), which they can only do authenticated."""
    import sys

    from netns_bench import Procs, python_env, read_line

    keys = os.path.join(workdir, "keys")
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "keygen", keys,
                          "--replicas", "3", "--name", "client"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    head = out[out.index("[cluster]"):]
    path = os.path.join(workdir, "curve.toml")
    with open(path, "w") as f:
        f.write(head + "\n")
        for i, ns in enumerate(nets.names):
            f.write(f'[[replica]]\nnode = "{ns}"\naddress = "tcp://{nets.ips[i]}:5710"\n\n')
    rogue = os.path.join(workdir, "rogue")
    subprocess.run([sys.executable, "-m", "zchannel.cli.main", "keygen", rogue, "--name", "x"],
                   capture_output=True, timeout=60, check=True)
    procs = Procs()
    client_secret = os.path.join(keys, "client.key_secret")
    started = []
    try:
        base = [sys.executable, "-m", "zchannel.cli.main", "broker", "sec", "--cluster", path]
        if start == "cli":
            # a replica without its key pair refuses to start (CURVE is on for the whole cluster)
            env = dict(python_env(workdir), ZCHANNEL_RUN_DIR=os.path.join(workdir, "run-x"))
            bad = subprocess.run(["ip", "netns", "exec", nets.names[0], *base, "--replica", "0"],
                                 capture_output=True, text=True, env={**os.environ, **env},
                                 timeout=60, cwd=workdir)
            assert bad.returncode != 0 and "--curve-secret-key" in bad.stderr, bad.stderr
        for i in range(3):
            env = dict(python_env(workdir), ZCHANNEL_RUN_DIR=os.path.join(workdir, f"run-{i}"))
            if start == "cli":
                argv = [*base, "--replica", str(i), "--curve-secret-key",
                        os.path.join(keys, f"replica{i}.key_secret")]
            else:  # the creator is a client too: it needs the client key pair
                env.update(ZCHANNEL_NODE=nets.names[i], ZCHANNEL_CURVE_SECRET_KEY=client_secret)
                argv = [sys.executable, "-c", CREATOR, "sec", path]
            started.append(procs.add(nets.popen(i, argv, env=env, stdout=subprocess.PIPE,
                                                stdin=subprocess.PIPE, cwd=workdir)))
        for p in started:
            line = read_line(p, 60)
            assert line == "ready True" if start == "create" else line.startswith("ready"), line

        def client(i: int, mode: str, secret: str | None) -> str:
            env = dict(python_env(workdir), ZCHANNEL_CLUSTER=path, ZCHANNEL_NODE=nets.names[i],
                       ZCHANNEL_RUN_DIR=os.path.join(workdir, f"client-{i}-{mode}"))
            if secret:
                env["ZCHANNEL_CURVE_SECRET_KEY"] = secret
            p = procs.add(nets.popen(i, [sys.executable, "-c", CURVE_CLIENT, mode, "sec"],
                                     env=env, stdout=subprocess.PIPE, cwd=workdir))
            return read_line(p, 120)

        # no keys at all; a key pair that is not listed
        assert client(1, "put", None) == "refused AuthenticationFailed"
        assert client(1, "put", os.path.join(rogue, "x.key_secret")) == "refused AuthenticationFailed"
        assert client(1, "put", client_secret) == f"put {nets.names[1]}"
        got = client(2, "get", client_secret).split()
        assert got[:3] == ["got", "secret-payload", nets.names[1]], got
        assert got[3] == "1,1,1", got  # the binding reached every replica (authenticated links)
        if start == "create":  # the creators stop their replicas
            for p in started:
                p.stdin.write(b"\n")
                p.stdin.flush()
                assert p.wait(timeout=60) == 0
    finally:
        procs.stop_all()
