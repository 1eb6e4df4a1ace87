"""Live control without a run: live-key validation like the config, the control socket's protocol and its errors."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from asyncrl.control import ControlError, ControlServer, find_run, request
from common.config import LIVE_KEYS, ConfigError, live_update, load_config


@pytest.fixture
def live_run(tmp_path: Path):
    """`tmp_path` held as a live driver holds its run (asyncrl/run_lock.py): control.json is asked only then."""
    from asyncrl import run_lock

    lock = run_lock.acquire(tmp_path)
    yield tmp_path
    lock.release()


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


def test_control_server_answers_and_survives_bad_requests(live_run: Path, tmp_path: Path):
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
        assert request(tmp_path, "ping")["echo"] == "ping"
        with pytest.raises(ControlError, match="refused: boom"):
            request(tmp_path, "boom")
        with pytest.raises(ControlError, match="RuntimeError: a handler bug"):
            request(tmp_path, "bug")
        raw = zmq.Context.instance().socket(zmq.REQ)
        raw.connect(endpoint)
        raw.send(b"\xc1 not msgpack")
        assert raw.poll(5000)
        assert msgpack.unpackb(raw.recv())["ok"] is False
        raw.send_multipart([b"a"] * 30)  # read as one frame, it broke the REP socket's order and killed the driver
        assert raw.poll(5000)
        reply = msgpack.unpackb(raw.recv())
        assert reply["ok"] is False and reply["error"] == "a request is one frame, got 30"
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
    # nobody holds the run: said at once (the message), not after the reply timeout as "no answer"
    with pytest.raises(ControlError, match=r"no running job under .* \(1 with a stale control.json"):
        find_run(None, runs_root=str(runs))
    with pytest.raises(ControlError, match=r"not running: its control.json is stale .* `asyncrl up --resume"):
        request(run_dir, "status", timeout_s=30)
    from asyncrl import run_lock

    lock = run_lock.acquire(run_dir)  # a live driver that does not answer
    try:
        assert find_run(None, runs_root=str(runs)) == run_dir
        with pytest.raises(ControlError, match="no answer from the driver .* it is busy"):
            request(run_dir, "status", timeout_s=0.5)
    finally:
        lock.release()


def test_a_request_without_the_runs_secret_is_refused(live_run: Path, tmp_path: Path):
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
        assert request(tmp_path, "ping")["echo"] == "ping"  # the owner, through control.json
        assert seen == ["ping"]
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


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"endpoint": 123, "secret": "s"}, "'endpoint' is 123"),
        ({"endpoint": "garbage", "secret": "s"}, "'endpoint' is 'garbage'"),
        ({"endpoint": "tcp://127.0.0.1:9"}, "it has no 'secret'"),
        (["tcp://127.0.0.1:9"], "not a JSON object"),
    ],
)
def test_a_corrupt_control_file_is_named_with_what_is_wrong(live_run: Path, tmp_path: Path, record, expected: str):
    (tmp_path / "control.json").write_text(json.dumps(record))
    with pytest.raises(ControlError, match="control.json is unreadable") as err:
        request(tmp_path, "status")
    assert expected in str(err.value)


def test_an_endpoint_zmq_refuses_is_a_control_error(live_run: Path, tmp_path: Path):
    (tmp_path / "control.json").write_text(json.dumps({"endpoint": "tcp://no such host", "secret": "s"}))
    with pytest.raises(ControlError, match="cannot reach the driver of .* at 'tcp://no such host'"):
        request(tmp_path, "status")


@pytest.mark.parametrize(
    ("cmd", "raw_reply", "expected"),
    [
        ("status", b"\xc1 not msgpack", "sent a reply that is not msgpack"),
        ("status", msgpack.packb([1, 2]), "unexpected reply"),
        ("status", msgpack.packb({"ok": True}), "no run, step, steps, version, workers"),
        ("scale", msgpack.packb({"ok": True, "added": []}), "no removed"),
        ("set", msgpack.packb({"ok": True}), "no changes, applies_at_step"),
        ("down", msgpack.packb({"ok": False}), "refused"),
    ],
)
def test_a_reply_that_is_not_the_protocols_is_a_control_error(
    live_run: Path, tmp_path: Path, cmd: str, raw_reply: bytes, expected: str
):
    """Something else on the endpoint, or a driver of another version: the CLI names it instead of failing on a
    missing field."""
    socket = zmq.Context.instance().socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    (tmp_path / "control.json").write_text(json.dumps({"endpoint": f"tcp://127.0.0.1:{port}", "secret": "s"}))

    def answer() -> None:
        if socket.poll(10_000):
            socket.recv()
            socket.send(raw_reply)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(ControlError, match=expected):
            request(tmp_path, cmd, timeout_s=10)
    finally:
        thread.join()
        socket.close(0)


def test_a_request_the_driver_would_drop_is_refused_before_it_is_sent(live_run: Path, tmp_path: Path):
    """The driver's socket drops a message over MAX_REQUEST_BYTES unanswered, which looked like a dead driver."""
    from asyncrl.control import MAX_REQUEST_BYTES, MAX_SET_ITEMS

    (tmp_path / "control.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:9", "secret": "s"}))
    with pytest.raises(
        ControlError, match=f"the set request is .* bytes; the driver takes at most {MAX_REQUEST_BYTES:,}"
    ):
        request(tmp_path, "set", items=["loss.cap=" + "9" * MAX_REQUEST_BYTES])
    with pytest.raises(ControlError, match=f"set takes at most {MAX_SET_ITEMS} key=value items, got 300"):
        request(tmp_path, "set", items=["loss.cap=3"] * 300)


@pytest.mark.parametrize("cmd", ["scale", "set"])
def test_a_stopping_run_refuses_scale_and_set(tmp_path: Path, cmd: str):
    """After `asyncrl down` (or a signal) the run starts no worker and applies no change it would never train with."""
    from types import SimpleNamespace

    from asyncrl.operations import Operations

    ops = SimpleNamespace(stopping=True, step=7, run_dir=tmp_path / "r", scale=None, set=None)
    with pytest.raises(ControlError, match=f"the run is stopping after step 7 .*: {cmd} is refused") as err:
        Operations.handle(ops, {"cmd": cmd, "rollout": 2, "items": ["loss.cap=3"]})
    assert f"asyncrl up --resume {tmp_path / 'r'}" in str(err.value)
    ops.stopping = False
    with pytest.raises(TypeError):  # not stopping: the request reaches the (here missing) handler
        Operations.handle(ops, {"cmd": cmd, "rollout": 2, "items": ["loss.cap=3"]})


FAKE_DRIVER = """
import os, sys, time
from pathlib import Path
from asyncrl import run_lock
from asyncrl.control import ControlServer
run_lock.acquire(Path(sys.argv[1]))  # as `asyncrl up` holds its run
server = ControlServer(Path(sys.argv[1]))
server.poll(lambda req: {"message": "stopping after step 3"}, 30_000)
print("answered", flush=True)
time.sleep(0.5)  # the reply leaves
if sys.argv[2] == "die":
    os._exit(9)  # killed after it accepted the stop: control.json stays behind
time.sleep(60)
"""


def _down_against_fake_driver(tmp_path: Path, then: str, reap: bool = True):
    import signal
    import subprocess
    import sys

    driver = subprocess.Popen([sys.executable, "-c", FAKE_DRIVER, str(tmp_path), then], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (tmp_path / "control.json").exists():
        assert time.monotonic() < deadline and driver.poll() is None
        time.sleep(0.05)
    # SIGINT as a terminal gives it, whatever this process inherited: a shell's background job (`pytest &`) ignores
    # SIGINT, its children inherit that, and `down` would never see the Ctrl-C this file sends it
    down = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "down", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert driver.stdout.readline() == "answered\n"
    if then == "die" and reap:
        driver.wait(timeout=60)  # reaped, as the shell that started a real driver would; else a zombie a while
    return driver, down


@pytest.mark.parametrize("reap", [True, False])
def test_down_says_so_when_the_driver_dies_before_it_has_stopped(tmp_path: Path, reap: bool):
    driver, down = _down_against_fake_driver(tmp_path, "die", reap)
    try:
        out, err = down.communicate(timeout=60)
    finally:
        driver.kill()
        down.kill()
    assert (tmp_path / "control.json").exists()  # what the killed driver left
    assert "stopping after step 3" in out
    assert down.returncode == 1, err
    assert f"(pid {driver.pid}) exited before it finished stopping" in err and "--resume" in err


def test_ctrl_c_while_down_waits_is_one_line_and_exit_130(tmp_path: Path):
    import signal

    driver, down = _down_against_fake_driver(tmp_path, "live")
    try:
        time.sleep(1.0)  # `down` is waiting for the (live, never stopping) driver
        down.send_signal(signal.SIGINT)
        out, err = down.communicate(timeout=60)
    finally:
        driver.kill()
        down.kill()
    assert down.returncode == 130, err
    assert err.strip() == f"asyncrl down: interrupted; the run is still stopping (asyncrl status {tmp_path})"


def test_a_driver_that_holds_the_run_but_does_not_answer_is_called_busy_not_dead(tmp_path: Path):
    """A second `down` while the driver stopped (workers, checkpoint) was told the run was not running, killed, and
    to resume it; one during start-up, that the run had ended or never started."""
    import subprocess
    import sys

    hold = ("import sys; from pathlib import Path; from asyncrl import run_lock; run_lock.acquire(Path(sys.argv[1]));"
            " print('held', flush=True); sys.stdin.read()")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ControlError, match=rf"its driver \(pid {holder.pid}\) runs: it is starting"):
            request(tmp_path, "down")
        socket = zmq.Context.instance().socket(zmq.REP)  # bound, never answering: a driver busy stopping
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        (tmp_path / "control.json").write_text(json.dumps({"endpoint": f"tcp://127.0.0.1:{port}", "secret": "s"}))
        with pytest.raises(ControlError, match=rf"\(pid {holder.pid}\) within 0s, though it runs: it is busy") as err:
            request(tmp_path, "down", timeout_s=0.3)
        assert "--resume" not in str(err.value)
        socket.close(0)
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_second_down_while_the_driver_stops_says_so_and_waits_for_the_end(live_run: Path):
    """Between its last step and its exit the driver answers nothing (workers stop, a checkpoint): a second `down`
    waited 10 s and said the run was busy (exit 2); it reads the stop from control.json and waits like the first."""
    import subprocess
    import sys

    server = ControlServer(live_run)  # never polled from here on, as a driver in its shutdown
    server.mark_stopping(after_step=3, reason="down")
    down = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "down", str(live_run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        time.sleep(1.0)
        assert down.poll() is None  # waiting for the stop to finish
        server.close()  # the driver exits: control.json goes
        out, err = down.communicate(timeout=30)
    finally:
        down.kill()
    assert down.returncode == 0, err
    assert out.splitlines() == ["already stopping (after step 3, on down)", f"{live_run}: stopped"]


def test_without_run_several_running_runs_are_listed_not_guessed(tmp_path: Path):
    """With two runs live under runs/, `asyncrl set` without RUN changed the newest, another person's run, and said
    nothing of which; now it asks for RUN, and what `set` and `scale` print names the run."""
    from asyncrl import run_lock

    runs = tmp_path / "runs"
    locks = []
    try:
        for name in ("a", "b"):
            (runs / name).mkdir(parents=True)
            ControlServer(runs / name).socket.close(0)  # its control.json
            locks.append(run_lock.acquire(runs / name))
        with pytest.raises(
            ControlError, match=r"2 runs are running under .*runs/ \(.*runs/a, .*runs/b\); name the one"
        ):
            find_run(None, runs_root=str(runs))
        locks.pop().release()  # b's driver gone: its control.json is stale, a is the one running
        assert find_run(None, runs_root=str(runs)) == runs / "a"
    finally:
        for lock in locks:
            lock.release()


def test_a_stopping_run_is_said_at_once_not_after_the_reply_timeout(live_run: Path, tmp_path: Path, capsys):
    """`status` on a run that is stopping waited 10 s for an answer the driver never gives while it stops, then said
    it was not running ("killed?")."""
    from asyncrl.cli import main
    from asyncrl.control import RunStopping

    server = ControlServer(live_run)  # nobody polls it: a driver between its last step and its exit
    try:
        server.mark_stopping(after_step=7, reason="down")
        # RunStopping comes from control.json before anything is sent (what a wait for the reply raises is not it)
        with pytest.raises(RunStopping, match=r"is stopping \(after step 7, on down; pid \d+\)"):
            request(live_run, "scale", rollout=3, timeout_s=3600)
        assert main(["status", str(live_run)]) == 0
        assert capsys.readouterr().out.strip() == f"run {live_run}: stopping (after step 7, on down): it answers no " \
                                                  "request until it has stopped"  # fmt: skip
        assert main(["set", "--run", str(live_run), "loss.cap=3"]) == 2
        assert "is stopping (after step 7, on down" in capsys.readouterr().err
    finally:
        server.close()
