"""`asyncrl scale` on a Ray cluster (`ray.address`) whose resources are taken: the workers that do not fit are added,
shown `pending` by `asyncrl status`, and start when a node joins (never a refusal); a pending worker scaled away
goes at once. Raylets on this machine with token authentication, as in test_multinode.py."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_cluster(temp_dir: Path) -> None:
    """Kill this test's raylets only (command lines naming its temp dir, and their children), not every Ray process
    of the machine as `ray stop` would."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if str(temp_dir) in " ".join(p.info["cmdline"] or [])]
    procs = {root.pid: root for root in roots}
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.update((child.pid, child) for child in root.children(recursive=True))
    for proc in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(list(procs.values()), timeout=10)


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) while waiting for {what}: {proc.stdout.read()}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_scale_past_a_clusters_resources_leaves_workers_pending_until_a_node_joins(tmp_path):
    temp_dir = Path("/tmp") / f"ray-sp-{os.getpid()}-{time.monotonic_ns() % 10**6}"  # short: socket path limits
    token_file = tmp_path / "cluster_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    rollout_node = [RAY, "start", "--address", address, "--num-cpus", "1", "--resources", '{"rollout_node": 1}',
                    "--disable-usage-stats"]  # fmt: skip
    proc = None
    try:
        subprocess.run([RAY, "start", "--head", "--num-cpus", "1", "--resources", '{"head": 1}', "--port", str(port),
                        "--include-dashboard", "false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                       check=True, env=env, capture_output=True, timeout=120)  # fmt: skip
        subprocess.run(rollout_node, check=True, env=env, capture_output=True, timeout=120)
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"), "logging.dir=runs",
             "logging.name=sp", "model.path=builtin:micro", "train.steps=100000", "train.groups_per_step=2",
             "train.group_size=4", "algo.filter_groups=false", "data.eval_size=0", "checkpoint.final=false",
             "logging.console=false", f"ray.address={address}", "rollout.num_workers=2", "ray.worker_cpus=0.5",
             "ray.worker_resources={rollout_node: 0.5}", "ray.learner_resources={head: 1}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
        run_dir = tmp_path / "runs" / "sp"

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True,
                                  env=env, cwd=tmp_path, timeout=60)  # fmt: skip

        def states() -> list[str]:
            status = cli("status", str(run_dir), "--json")
            assert status.returncode == 0, status.stderr
            return [w["state"] for w in json.loads(status.stdout)["workers"]]

        def stepped() -> bool:  # the driver answers control requests from its step loop on
            metrics = run_dir / "metrics.jsonl"
            return metrics.is_file() and '"loss"' in metrics.read_text()

        wait_for(stepped, 300, "the first step", proc)
        assert states() == ["running", "running"]
        scaled = cli("scale", "rollout=3", "--run", str(run_dir))  # the rollout node holds 2 workers of 0.5
        assert scaled.returncode == 0, scaled.stderr
        wait_for(lambda: states() == ["running", "running", "pending"], 60, "a pending third worker", proc)
        time.sleep(5)  # it stays pending while no node has room
        assert states() == ["running", "running", "pending"]
        assert "pending" in cli("status", str(run_dir)).stdout
        assert cli("scale", "rollout=2", "--run", str(run_dir)).returncode == 0  # a pending worker goes at once
        wait_for(lambda: states() == ["running", "running"], 60, "the pending worker removed", proc)
        assert cli("scale", "rollout=3", "--run", str(run_dir)).returncode == 0
        wait_for(lambda: states() == ["running", "running", "pending"], 60, "a pending third worker again", proc)
        subprocess.run(rollout_node, check=True, env=env, capture_output=True, timeout=120)  # a node joins
        wait_for(lambda: states() == ["running"] * 3, 300, "the third worker to start on the new node", proc)
        down = cli("down", str(run_dir))
        assert down.returncode == 0, down.stderr
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-4000:]
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        stop_cluster(temp_dir)
