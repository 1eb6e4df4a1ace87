"""A local cluster's head starts without Ray's autoscaler monitor and the dashboard's API server (issue 27: two
Python processes of start-up CPU), still runs actors, and `Node` is left as Ray made it."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, os
from pathlib import Path
from asyncrl.raycluster import LEAN_HEAD_SKIPS, connect
from common.config import load_config

cfg = load_config(None, ["ray.num_cpus=2"])
connect(cfg.ray, warn=lambda *_: None)
import ray
from ray._private.node import Node

def descendants(root):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\\0", b" ").decode()
            except OSError:
                continue
            children.setdefault(parent, []).append((int(entry), command))
    found, pending = [], [root]
    while pending:
        for pid, command in children.get(pending.pop(), []):
            found.append(command)
            pending.append(pid)
    return found

class Echo:
    def pid(self):
        return os.getpid()

try:
    pid = ray.get(ray.remote(num_cpus=1)(Echo).remote().pid.remote(), timeout=120)
    commands = descendants(os.getpid())
    print("RESULT" + json.dumps({
        "monitor": any("autoscaler/_private/monitor.py" in c for c in commands),
        "dashboard": any("dashboard/dashboard.py" in c for c in commands),
        "raylet": any("raylet/raylet" in c for c in commands),
        "actor_ran": pid != os.getpid(),
        "node_restored": all(getattr(Node, name).__module__ == "ray._private.node" for name in LEAN_HEAD_SKIPS),
    }))
finally:
    ray.shutdown()
"""


def test_a_local_cluster_starts_without_the_monitor_and_the_api_server() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, done.stdout + done.stderr
    assert json.loads(lines[0][len("RESULT") :]) == {
        "monitor": False, "dashboard": False, "raylet": True, "actor_ran": True, "node_restored": True,
    }  # fmt: skip
