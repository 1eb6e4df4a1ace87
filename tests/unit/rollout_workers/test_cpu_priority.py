"""`rollout.cpu_priority`: which runs put their workers under SCHED_IDLE, and that every thread of the process (and
one started later) then runs under it, checked in a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.config import load_config
from common.config_rules import worker_cpu_priority

PROBE = """
import json, os, threading
from rollout_workers.cpu_priority import is_idle, lower_to_idle
before = threading.Event(); stop = threading.Event()
early = threading.Thread(target=lambda: (before.set(), stop.wait()), daemon=True)
early.start(); before.wait()
lowered = lower_to_idle()
seen = {}
late = threading.Thread(target=lambda: seen.update(late=is_idle()))
late.start(); late.join()
def policy(tid):
    try:
        return os.sched_getscheduler(int(tid))
    except ProcessLookupError:  # `late`, joined but still listed while it exits
        return None
policies = {tid: p for tid in os.listdir("/proc/self/task") if (p := policy(tid)) is not None}
stop.set(); early.join()
print(json.dumps({"lowered": lowered, "main": is_idle(), "late": seen["late"], "policies": policies}))
"""


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "idle"),  # the default: asynchronous (max_lag 2), embedded, CPU
        (["staleness.max_lag=0"], "normal"),  # synchronous: the learner waits while the workers generate
        (["rollout.cpu_priority=normal"], "normal"),
        (["rollout.cpu_priority=idle", "staleness.max_lag=0"], "idle"),
        (["rollout.device=cuda"], "normal"),
    ],
)
def test_auto_is_idle_only_for_an_asynchronous_run_on_the_cpu(overrides, expected):
    cfg = load_config(None, ["staleness.max_lag=2", *overrides])
    assert worker_cpu_priority(cfg.rollout, cfg.staleness) == expected


def test_a_worker_built_outside_a_run_keeps_its_priority_and_one_told_idle_lowers_its_process(tmp_path):
    """`auto` is the driver's to resolve: a worker built in this process (tests, an embedding) with the defaults leaves
    the process as it is; one given `idle` (what the driver resolves for an async run) lowers its own process."""
    script = (
        "import json, os\n"
        "from common.builtin_model import resolve_model_path\n"
        "from common.config import load_config, to_dict\n"
        "from rollout_workers.cpu_priority import is_idle\n"
        "from rollout_workers.sections import WorkerSections\n"
        "from rollout_workers.worker import RolloutWorker\n"
        "seen = []\n"
        "for value in ('auto', 'idle'):\n"
        "    cfg = load_config(None, [f'rollout.cpu_priority={value}'])\n"
        "    RolloutWorker(to_dict(WorkerSections.pick(cfg)), 'w0', str(resolve_model_path(cfg.model.path)),\n"
        "                  'tcp://127.0.0.1:9')\n"
        "    seen.append(is_idle())\n"
        "print(json.dumps(seen))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, True]


def test_a_bad_priority_is_refused_naming_the_key():
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.cpu_priority"):
        load_config(None, ["rollout.cpu_priority=low"])


def test_every_thread_and_one_started_later_run_under_sched_idle():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(done.stdout)
    assert report["lowered"] and report["main"] and report["late"]
    assert len(report["policies"]) >= 2 and set(report["policies"].values()) == {os.SCHED_IDLE}
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # this process is untouched


GONE_PROBE = """
import json, os, threading, time
from rollout_workers.cpu_priority import is_idle, lower_to_idle
ended = threading.Thread(target=lambda: None)
ended.start(); ended.join()
while os.path.exists(f"/proc/self/task/{ended.native_id}"):
    time.sleep(0.001)
listed = os.listdir
os.listdir = lambda path: [*listed(path), str(ended.native_id)] if path == "/proc/self/task" else listed(path)
print(json.dumps({"lowered": lower_to_idle(), "main": is_idle()}))
"""


def test_a_thread_that_ends_while_the_process_is_lowered_is_skipped():
    """A thread still listed in /proc/self/task but gone by the time its policy is set (ESRCH) is not a refusal."""
    done = subprocess.run([sys.executable, "-c", GONE_PROBE], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"lowered": True, "main": True}, done.stderr
