"""``zchannel bench``: bounded load on a channel broker, compared with baselines in the same run.

Every scenario starts a broker (or uses ``--address``) and producer/consumer worker processes
(``spawn``), releases them together after a readiness handshake, checks every item on arrival
(content and sequence numbers) and prints one row per case: items/s, MB/s, p50/p99 latency, the
broker's peak RSS (``VmHWM``) and the ratio to the baseline measured on the same payloads
(medians over ``--repeat`` runs).  A content mismatch, a lost or a duplicated item fails the run
(exit 1).

Modules, by responsibility:

* ``cases``: what is measured (``Case``, ``Measured``, the cases of each scenario);
* ``payloads``: self-checking items and the checks of what arrived;
* ``workers``: worker processes with a readiness handshake, ended by PID;
* ``channel``: the broker under test and its producer/consumer workers;
* ``baselines``: raw ``zmq.proxy`` relay, raw echo, ``multiprocessing.Queue``, Ray;
* ``runner``: repeats in rounds with the baselines, medians into report rows;
* ``targets``: the target suite (``--targets``), thresholds read from
  ``configs/bench_targets.toml``;
* ``trajectory``: the ``embodied_trajectory`` collector scenario (loaded when it runs);
* ``report``: the table, its legend, progress, the JSON file;
* ``command``: the click command.
"""

from zchannel.cli.bench.cases import parse_size
from zchannel.cli.bench.command import bench

__all__ = ["bench", "parse_size"]
