"""Live control without a run: live-key validation like the config, the control socket's protocol and its errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import msgpack
import pytest
import zmq

from asyncrl.control import ControlError, ControlServer, find_run, request
from common.config import LIVE_KEYS, ConfigError, live_update, load_config


def test_live_update_validates_like_the_config():
    cfg = load_config(None, ["model.path=builtin:micro"])
    assert live_update(cfg, ["staleness.max_lag=0", "loss.acrl.gamma=0.5", "optim.lr=3e-4"]) == {
        "staleness.max_lag": 0, "loss.acrl.gamma": 0.5, "optim.lr": 3e-4,
    }  # fmt: skip
    assert cfg.staleness.max_lag == 2  # validated, not applied
    for item, expected in [
        ("loss.cpa=3", "did you mean `loss.cap`"),
        ("rollout.temperature=0.5", ", ".join(LIVE_KEYS)),
        ("loss.cap=0.5", "out of range"),
        ("staleness.max_lag=two", "staleness.max_lag"),
        ("loss.cap", "key=value"),
        ("loss.cap=[1", "the value is not valid YAML"),
    ]:
        with pytest.raises(ConfigError) as err:
            live_update(cfg, [item])
        assert expected in str(err.value), (item, str(err.value))


def test_control_server_answers_and_survives_bad_requests(tmp_path: Path):
    server = ControlServer(tmp_path)
    endpoint = json.loads((tmp_path / "control.json").read_text())["endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:")

    def handler(req):
        if req["cmd"] == "boom":
            raise ControlError("refused: boom")
        if req["cmd"] == "bug":  # anything a handler may raise (a YAML error, a buffer timeout, a bug)
            raise RuntimeError("a handler bug")
        return {"echo": req["cmd"]}

    stop = threading.Event()
    thread = threading.Thread(target=lambda: [server.poll(handler, 50) for _ in iter(stop.is_set, True)])
    thread.start()
    try:
        assert request(tmp_path, "status")["echo"] == "status"
        with pytest.raises(ControlError, match="refused: boom"):
            request(tmp_path, "boom")
        with pytest.raises(ControlError, match="RuntimeError: a handler bug"):
            request(tmp_path, "bug")
        raw = zmq.Context.instance().socket(zmq.REQ)
        raw.connect(endpoint)
        raw.send(b"\xc1 not msgpack")
        assert raw.poll(5000)
        assert msgpack.unpackb(raw.recv())["ok"] is False
        raw.close(0)
        assert request(tmp_path, "again")["echo"] == "again"  # still serving
    finally:
        stop.set()
        thread.join()
        server.close()
    assert not (tmp_path / "control.json").exists()


def test_control_errors_name_the_problem(tmp_path: Path):
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    with pytest.raises(ControlError, match="no run directory"):
        find_run(str(tmp_path / "nope"))
    with pytest.raises(ControlError, match="no running job under"):
        find_run(None, runs_root=str(runs))
    with pytest.raises(ControlError, match="not running: no control.json"):
        request(run_dir, "status")
    socket = zmq.Context.instance().socket(zmq.REP)  # a port nobody answers on: a driver that was killed
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    socket.close(0)
    (run_dir / "control.json").write_text(json.dumps({"endpoint": f"tcp://127.0.0.1:{port}", "secret": "s"}))
    assert find_run(None, runs_root=str(runs)) == run_dir
    with pytest.raises(ControlError, match="no answer from the driver"):
        request(run_dir, "status", timeout_s=0.5)


def test_a_request_without_the_runs_secret_is_refused(tmp_path: Path):
    """control.json is private to the run's user (0600) and holds a secret; a local process that only knows the
    port (any user can connect to loopback) is refused whatever it asks, and the handler never sees it."""
    import os
    import stat

    server = ControlServer(tmp_path)
    record = json.loads((tmp_path / "control.json").read_text())
    assert stat.S_IMODE(os.stat(tmp_path / "control.json").st_mode) == 0o600
    assert len(record["secret"]) >= 32
    seen: list[str] = []

    def handler(req):
        seen.append(req["cmd"])
        assert "secret" not in req  # the handler never gets (or logs) the secret
        return {"echo": req["cmd"]}

    stop = threading.Event()
    thread = threading.Thread(target=lambda: [server.poll(handler, 50) for _ in iter(stop.is_set, True)])
    thread.start()
    raw = zmq.Context.instance().socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(record["endpoint"])
        for secret in (None, "", "0" * 64, record["secret"][:-1] + "x", 7):
            req = {"v": 1, "cmd": "down"} | ({} if secret is None else {"secret": secret})
            raw.send(msgpack.packb(req))
            assert raw.poll(5000)
            reply = msgpack.unpackb(raw.recv())
            assert reply["ok"] is False and "lacks this run's secret" in reply["error"], reply
        assert seen == []
        assert request(tmp_path, "status")["echo"] == "status"  # the owner, through control.json
        assert seen == ["status"]
    finally:
        raw.close(0)
        stop.set()
        thread.join()
        server.close()


@pytest.mark.parametrize("target", ["rollout=²", "rollout=99999999999999999999999", "rollout=-1", "workers=2"])
def test_scale_rejects_what_is_not_a_worker_count_before_asking_the_driver(tmp_path: Path, target: str):
    import subprocess
    import sys

    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "control.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:9", "secret": "s"}))  # nobody there
    args = [sys.executable, "-m", "asyncrl.cli", "scale", target, "--run", str(run_dir)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "scale takes rollout=N (a whole number" in proc.stderr, proc.stderr


def test_a_model_directory_with_its_own_code_is_refused_unless_trusted(tmp_path: Path):
    """issue 23: model directories are data; `auto_map` (code shipped with the model) needs model.trust_remote_code."""
    from asyncrl.driver import StartupError, check_model_code

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    check_model_code(str(tmp_path), trust_remote_code=False)  # plain weights: fine
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    with pytest.raises(StartupError, match="ships its own code.*model.trust_remote_code=true"):
        check_model_code(str(tmp_path), trust_remote_code=False)
    check_model_code(str(tmp_path), trust_remote_code=True)
