"""`asyncrl up` on a Ray cluster (`ray.address`) with token authentication on: two raylets on this machine with
distinct custom resources, rollout workers placed on the second one by `ray.worker_resources`; a client without the
cluster's token is refused."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
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
    """Kill the processes of this test's cluster only (those whose command line names its temp dir, and their
    children), not every Ray process of the machine as `ray stop` would."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if str(temp_dir) in " ".join(p.info["cmdline"] or [])]
    procs = {root.pid: root for root in roots}
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.update((child.pid, child) for child in root.children(recursive=True))
    for proc in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(list(procs.values()), timeout=10)


def token_env(token_file: Path) -> dict[str, str]:
    """This process's environment with the cluster's token, as a user who joins it sets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "cluster_token"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


@pytest.fixture
def cluster(tmp_path, token_file):
    temp_dir = Path("/tmp") / f"ray-mn-{os.getpid()}-{time.monotonic_ns() % 10**6}"  # short: socket path limits
    env = token_env(token_file)
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        subprocess.run([RAY, "start", "--head", "--num-cpus", "1", "--resources", '{"head": 1}', "--port", str(port),
                        "--include-dashboard", "false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                       check=True, env=env, capture_output=True, timeout=120)  # fmt: skip
        subprocess.run([RAY, "start", "--address", address, "--num-cpus", "1", "--resources", '{"rollout_node": 1}',
                        "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=120)  # fmt: skip
        yield address
    finally:
        stop_cluster(temp_dir)


def nodes_with(address: str, resource: str, token_file: Path) -> list[str]:
    code = (
        f"import ray, json; ray.init(address={address!r}); "
        f"print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive'] and {resource!r} in n['Resources']]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=token_env(token_file), check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_up_on_a_two_node_cluster_places_workers_by_resource(cluster, tmp_path, token_file):
    deadline = time.monotonic() + 60
    while not nodes_with(cluster, "rollout_node", token_file):  # the second raylet registers shortly after `ray start`
        assert time.monotonic() < deadline, "the second raylet never joined"
        time.sleep(1)
    (rollout_node,) = nodes_with(cluster, "rollout_node", token_file)
    (head_node,) = nodes_with(cluster, "head", token_file)
    steps = 3
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}",
         "logging.name=mn", "model.path=builtin:micro", f"train.steps={steps}", "train.groups_per_step=2",
         "train.group_size=4", "algo.filter_groups=false", "data.eval_size=0", "checkpoint.final=false",
         f"ray.address={cluster}", "rollout.num_workers=2", "ray.worker_cpus=0.5",
         "ray.worker_resources={rollout_node: 0.5}", "ray.learner_resources={head: 1}"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=token_env(token_file),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "mn" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(steps))
    started = [r for r in rows if r.get("event") == "worker_started"]
    assert len(started) == 2 and {r["node"] for r in started} == {rollout_node}
    assert rollout_node != head_node


@pytest.mark.slow
def test_a_client_without_the_clusters_token_is_refused(cluster, tmp_path, token_file):
    """A Ray client that sends no token, or a wrong one, cannot talk to the cluster; `asyncrl up` without the token
    stops before starting anything, naming what to set."""
    from asyncrl.raycluster import probe_open

    assert probe_open(cluster) is False  # a real GCS client that sends no token: refused
    wrong = tmp_path / "wrong_token"
    wrong.write_text(secrets.token_hex(32))
    code = (
        "import sys\nfrom ray._raylet import GcsClient\ntry:\n"
        f"    GcsClient(address={cluster!r}).internal_kv_get(b'x', None, timeout=10)\n"
        "except Exception as err:\n    print(type(err).__name__, err)\nelse:\n    print('admitted')\n"
    )
    for env in (token_env(wrong), token_env(token_file)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        last = out.stdout.strip().splitlines()[-1]
        if env["RAY_AUTH_TOKEN_PATH"] == str(wrong):
            assert last.startswith("AuthenticationError"), out.stdout + out.stderr[-2000:]
        else:
            assert last == "admitted", out.stdout + out.stderr[-2000:]
    home = tmp_path / "home"  # no ~/.ray/auth_token either
    home.mkdir()
    cache = os.environ.get("ASYNCRL_CACHE", str(Path.home() / ".cache" / "asyncrl"))  # the built models, not rebuilt
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")} | {"HOME": str(home)}
    env["ASYNCRL_CACHE"] = cache
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}",
         "model.path=builtin:micro", f"ray.address={cluster}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "the cluster needs its token; set RAY_AUTH_TOKEN_PATH" in proc.stderr, proc.stderr[-3000:]
