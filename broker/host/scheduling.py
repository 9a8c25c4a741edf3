"""The broker's CPU scheduling policy: Linux's ``SCHED_BATCH`` for its loop.

A broker sleeps and wakes thousands of times a second under a stream of small items. Under
the default policy (``SCHED_OTHER``) each wake-up preempts the client running on that CPU,
and on a machine whose cores the clients keep busy the broker then runs a short turn with
little work in it. Under ``SCHED_BATCH`` a waking broker does not preempt: it runs when a CPU
is free (a client waits) or at the next scheduler tick, finds more records waiting, and
handles them in one turn. Its share of the CPU is unchanged (same nice level); only the
wake-up preemption goes (``sched(7)``). ``docs/decisions.md``, "The broker runs as a batch
task", has the measurements; ``sched_batch = false`` (config), ``--no-sched-batch`` (CLI) or
``ZCHANNEL_SCHED_BATCH=0`` (environment) keep the default policy.
"""

from __future__ import annotations

import logging
import os

from zchannel.broker.host.environ import env_flag

log = logging.getLogger("zchannel.broker")

ENV = "ZCHANNEL_SCHED_BATCH"


def batch_wanted(configured: bool) -> bool:
    """Whether the broker asks for ``SCHED_BATCH``: its config says so and ``ZCHANNEL_SCHED_BATCH``
    does not say no (``ValueError`` naming the variable for a value that is neither)."""
    return configured and env_flag(ENV, True)


def use_batch_policy() -> str:
    """Put the calling thread (and the threads it starts from now on) under ``SCHED_BATCH`` when
    it runs under the default policy; the policy it runs under afterwards: ``"batch"``,
    ``"other"`` (not Linux, or the system refused) or ``"kept"`` (a policy someone chose, such
    as a real-time one, is left alone)."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or not hasattr(os, "sched_setscheduler"):
        return "other"
    try:
        policy = os.sched_getscheduler(0)
        if policy == batch:
            return "batch"
        if policy != os.SCHED_OTHER:
            return "kept"
        os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError as exc:  # a sandbox that forbids it: the default policy stays
        log.debug("SCHED_BATCH not applied: %s", exc)
        return "other"
    return "batch"
