"""A rollout worker's OS scheduling on a machine it shares with the learner (`rollout.cpu_priority`).

An asynchronous run on one machine puts the learner and the workers on the same cores. Under the default scheduler
each runnable thread gets an equal share, so a worker preempts the learner's torch threads in the middle of a
parallel GEMM, and the learner's other thread waits at the barrier: the learner, the usual bound, slows by more
than the worker gains. Under SCHED_IDLE (Linux) a worker runs on the cycles no normal thread wants: the learner keeps
the cores it asked for, and generation fills its gaps (publishing, metrics, its single-threaded Python, its waits).
Measured on 2 Zen 4 cores, 60-step runs: the built-in task's loop step 54-56 ms against 61-62 ms; the 100M decode
workload of `asyncrl bench e2e`, 18.4 s against 19.7 s per step. The kernel still gives an idle thread a sliver of
a busy core, so heartbeats and leases keep going.

Every thread of the process is set (the main thread, the weight subscriber, torch's OpenMP pool if it exists);
threads started later inherit it from the thread that starts them.
"""

from __future__ import annotations

import os
import sys


def lower_to_idle() -> bool:
    """Put every thread of this process under SCHED_IDLE; False where the OS has no such policy (not Linux) or
    refuses (a note on stderr: the worker goes on at normal priority)."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return False
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended since the listing (still listed while it exits)
                continue
    except (OSError, ValueError) as err:  # a sandbox that forbids it
        print(f"rollout worker: SCHED_IDLE refused ({err}); running at normal priority", file=sys.stderr)
        return False
    return True


def is_idle() -> bool:
    """Whether this thread runs under SCHED_IDLE."""
    policy = getattr(os, "SCHED_IDLE", None)
    return policy is not None and os.sched_getscheduler(0) == policy
