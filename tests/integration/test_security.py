"""Nobody gets in: every process of a default run listens on loopback only, its Ray cluster wants a token, and its
buffer and weight publisher admit only the run's own CurveZMQ keys (`buffer.run_keys`)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1 on an IPv6 socket
    return address.is_loopback


def listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket and bound, unconnected UDP socket."""
    rows = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            name = " ".join(proc.cmdline()[:3])[:80] or proc.name()
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr):  # 2: SOCK_DGRAM
                    rows.append((name, conn.laddr.ip, conn.laddr.port))
    return rows


def wait_for_steps(metrics: Path, proc: subprocess.Popen, steps: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (metrics.parent.parent / "up.err").read_text()[-3000:]
        if metrics.is_file():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if sum("loss" in r for r in rows) >= steps:
                return
        time.sleep(0.5)
    raise AssertionError(f"no {steps} steps within {timeout_s} s")


@pytest.mark.slow
def test_a_default_run_listens_on_loopback_only_and_its_ray_wants_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}  # the user sets nothing
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"), f"logging.dir={tmp_path}",
         "logging.name=sec", "model.path=builtin:micro", "train.steps=400", "data.eval_size=0",
         "checkpoint.final=false", "ray.launcher=ray"],  # Ray's token (issue 23); local actors have no port
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "up.err").open("w"),
    )  # fmt: skip
    try:
        wait_for_steps(tmp_path / "sec" / "metrics.jsonl", proc, steps=2, timeout_s=300)
        driver = psutil.Process(proc.pid)
        tree = [driver, *driver.children(recursive=True)]
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        for part in ("gcs_server", "raylet", "-m buffer", "RolloutWorker", "Learner"):
            assert part in names, f"{part} is not in the run's process tree: the check would prove nothing"
        rows = listening(tree)
        assert len(rows) >= 6, rows  # gcs, raylet x2, core workers, the buffer, the publisher, control, ...
        wide = [row for row in rows if not is_loopback(row[1])]
        assert wide == [], f"listening beyond loopback: {wide}"

        gcs_server = next(p for p in tree if p.name() == "gcs_server")  # started with the driver's settings
        token_path = Path(gcs_server.environ()["RAY_AUTH_TOKEN_PATH"])
        assert gcs_server.environ()["RAY_AUTH_MODE"] == "token"
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600 and len(token_path.read_text()) >= 32
        # Ray's temp directory (which Ray opens to 0777) and the token inside a private directory: the token was in
        # Ray's, where another local user could replace it
        private = token_path.parent
        assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.name.startswith("asyncrl-ray-")
        assert any(str(private / "ray") in arg for arg in gcs_server.cmdline()), gcs_server.cmdline()
        gcs_ports = [c.laddr.port for c in gcs_server.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        from asyncrl.raycluster import probe_open

        assert probe_open(f"127.0.0.1:{gcs_ports[0]}") is False  # a Ray client without the run's token is refused
        control = tmp_path / "sec" / "control.json"
        assert stat.S_IMODE(control.stat().st_mode) == 0o600
        keys_dir = check_the_sockets_admit_only_the_runs_keys(tmp_path / "sec", tree)
    finally:
        proc.terminate()  # a graceful stop, as Ctrl-C: the driver stops its workers, buffer and Ray
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (tmp_path / "up.err").read_text()[-3000:]
    assert not keys_dir.exists(), "the run's keys outlived it"
    assert not private.exists(), "Ray's token and temp directory outlived the run"


def check_the_sockets_admit_only_the_runs_keys(run_dir: Path, tree: list[psutil.Process]) -> Path:
    """A local process without the run's keys (none, or keys of its own) gets no answer from the buffer or the weight
    publisher; with them it does. Returns the run's keys directory."""
    from buffer.client import BufferClient, BufferUnavailable
    from common.curve import client_keys, create_keys

    keys_dir = Path(json.loads((run_dir / "buffer_config.json").read_text())["buffer"]["curve_keys_dir"])
    assert json.loads((run_dir / "config.json").read_text())["buffer"]["curve_keys_dir"] == ""  # a resume: new keys
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in keys_dir.glob("*_secret")} == {0o600}
    owner, intruder = client_keys(str(keys_dir)), client_keys(str(create_keys(run_dir.parent / "intruder")[0].parent))
    endpoint = next(json.loads(line)["endpoint"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                    if '"buffer_started"' in line)  # fmt: skip
    for curve in (None, intruder):
        with BufferClient(endpoint, "intruder", timeout_s=3, curve=curve) as client, pytest.raises(BufferUnavailable):
            client.stats()
    with BufferClient(endpoint, "owner", timeout_s=10, curve=owner) as client:
        assert client.stats()["rejected_handshakes"] >= 2
    learner = next(p for p in tree if "Learner" in " ".join(p.cmdline()))
    ports = [c.laddr.port for c in learner.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    publisher = [port for port in ports if weights_answer(port, owner)]  # Ray's gRPC servers answer no ZMQ client
    assert len(publisher) == 1, ports
    assert not weights_answer(publisher[0], None) and not weights_answer(publisher[0], intruder)
    return keys_dir


def weights_answer(port: int, curve) -> bool:
    """Whether a ZMQ DEALER on 127.0.0.1:`port` with `curve` keys (or none) gets an answer to a weight `get`."""
    import msgpack
    import zmq

    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.linger = 0
        if curve is not None:
            socket.curve_publickey, socket.curve_secretkey, socket.curve_serverkey = (
                curve.public, curve.secret, curve.server_public)  # fmt: skip
        socket.sndtimeo = 3000  # a refused handshake drops the pipe: a blocking send would then wait for ever
        socket.connect(f"tcp://127.0.0.1:{port}")
        try:
            socket.send(msgpack.packb({"v": 2, "type": "get", "have": -1}))
        except zmq.Again:
            return False
        return bool(socket.poll(3000))
    finally:
        context.destroy(linger=0)
