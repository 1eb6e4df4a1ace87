"""Live control of a running job from another terminal: `asyncrl status | scale | set | down`.

    asyncrl status/scale/set/down --REQ, msgpack--> driver (REP on 127.0.0.1, polled by its step loop)
                                  <--REP, msgpack--  {"ok": true, ...} | {"ok": false, "error": "..."}

The driver binds a REP socket on 127.0.0.1 (a free port) and writes its endpoint and a per-run secret to
runs/<name>/control.json (mode 0600: only the run's user can read it); the file is removed when the driver exits.
Every request carries that secret; one without it, or with another, is refused (`ok: false`) whatever it asks, so a
process of another local user that can reach the loopback port can neither stop nor steer the run, nor read its
status. Requests and replies are msgpack maps (never pickle), size-limited:

| request | reply fields | effect |
|---|---|---|
| `{"cmd": "status"}` | run, step, steps, version, workers, buffer, staleness, throughput, live, errors | none |
| `{"cmd": "scale", "rollout": N}` | added, removed | workers added now (`pending` till placed); removed ones finish |
| `{"cmd": "set", "items": ["k=v", ...]}` | changes, applies_at_step | validated now, applied at the next step |
| `{"cmd": "down"}` | message | stop after the current step: workers stopped, checkpoint, journal flushed |

`set` accepts only `common.config.LIVE_KEYS` and validates them exactly like the config (`live_update`). A request
that does not decode, or names an unknown command, gets `ok: false` with the reason; the driver never dies of one.
This module imports no torch or ray: the CLI side (`request`, `find_run`) must start instantly.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from asyncrl import run_lock

CONTROL_FILE = "control.json"
MAX_REQUEST_BYTES = 1 << 16
MAX_SET_ITEMS = 256
"""The most `key=value` items one `set` request carries (the driver decodes no longer array)."""
PROTOCOL_VERSION = 1
REPLY_FIELDS = {
    "status": ("run", "step", "steps", "version", "workers"),
    "scale": ("added", "removed"),
    "set": ("changes", "applies_at_step"),
    "down": ("message",),
}
"""The fields each command's reply must carry (the table above) for the CLI to show it."""


class ControlError(RuntimeError):
    """A control request failed: no such run, nobody answers, or the driver refused it (the message says why)."""


class RunStopping(ControlError):
    """The run is stopping (control.json says so): its driver answers no request until it has stopped."""


class ControlServer:
    """The driver's end: `poll(handler, timeout_ms)` answers the requests that arrived (each with handler(req))."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / CONTROL_FILE
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.secret = secrets.token_hex(32)
        self.record = {"endpoint": self.endpoint, "pid": os.getpid(), "started": time.time(), "secret": self.secret}
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(CONTROL_FILE + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private from the first byte
        with os.fdopen(fd, "w") as handle:
            json.dump(self.record, handle)
        tmp.rename(self.path)

    def mark_stopping(self, after_step: int, reason: str) -> None:
        """Say in control.json that the run is stopping: between its last step and its exit (workers, checkpoint,
        final save) the driver answers no request, and `down` or `status` read this instead of waiting it out."""
        self.record["stopping"] = {"after_step": after_step, "reason": reason}
        with contextlib.suppress(OSError):
            self._write()

    def poll(self, handler: Callable[[dict[str, Any]], dict[str, Any]], timeout_ms: int = 0) -> int:
        """Answer every pending request (waiting up to `timeout_ms` for the first); returns how many."""
        answered = 0
        while self.socket.poll(timeout_ms if answered == 0 else 0, zmq.POLLIN):
            frames = self.socket.recv_multipart()  # all of them: a REP socket answers only after the last
            try:
                if len(frames) != 1:
                    raise ControlError(f"a request is one frame, got {len(frames)}")
                raw = frames[0]
                request = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_array_len=MAX_SET_ITEMS, max_map_len=32)
                if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
                    raise ControlError('a request must be a map with a string "cmd"')
                given = request.pop("secret", None)
                if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.secret.encode()):
                    raise ControlError(f"refused: the request lacks this run's secret (read from {self.path})")
                reply = {"ok": True, **handler(request)}
            except ControlError as err:
                reply = {"ok": False, "error": str(err)}
            except Exception as err:  # undecodable, or whatever a request does: answered, and training goes on
                reply = {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
            with contextlib.suppress(zmq.ZMQError):  # the asker is gone: no reply, and training goes on
                self.socket.send(msgpack.packb(reply, use_bin_type=True, default=str))
            answered += 1
        return answered

    def close(self) -> None:
        self.socket.close(0)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def find_run(run: str | None, runs_root: str = "runs") -> Path:
    """The run directory `run`, or the one directory under `runs_root` whose driver runs; with several running,
    ControlError listing them (it took the newest: a `set` without RUN changed another person's run)."""
    if run:
        path = Path(run)
        if not path.is_dir():
            raise ControlError(f"no run directory {run!r}")
        return path
    root = Path(runs_root)
    served = [p for p in root.glob("*") if (p / CONTROL_FILE).is_file()] if root.is_dir() else []
    candidates = [p for p in served if run_lock.holder(p) is not None]  # a killed driver's control.json stays
    if not candidates:
        stale = f" ({len(served)} with a stale {CONTROL_FILE}: their driver was killed)" if served else ""
        raise ControlError(f"no running job under {root}/ (no */{CONTROL_FILE} of a live driver){stale}; name the "
                           "run directory: RUN")  # fmt: skip
    if len(candidates) > 1:
        listed = ", ".join(str(path) for path in sorted(candidates)[:8]) + (", ..." if len(candidates) > 8 else "")
        raise ControlError(f"{len(candidates)} runs are running under {root}/ ({listed}); name the one: RUN")
    return candidates[0]


def driver_record(run_dir: Path) -> dict[str, Any]:
    """control.json of `run_dir`: its endpoint (a tcp:// address), secret and the driver's pid; ControlError naming
    what is wrong with it."""
    control = run_dir / CONTROL_FILE
    if not control.is_file():
        driver = run_lock.holder(run_dir)
        if driver is not None:  # `asyncrl up` has the run, and its control socket is not open yet (or any more)
            raise ControlError(
                f"{run_dir} has no control socket now, but its driver (pid {driver or '?'}) runs: it is starting "
                "(the socket opens once its actors are up) or ending; try again"
            )
        raise ControlError(f"{run_dir} is not running: no {CONTROL_FILE} (the run ended, or never started)")
    try:
        record = json.loads(control.read_text())
    except PermissionError:
        raise ControlError(f"{control} is not readable by this user: only the run's owner controls it") from None
    except (OSError, ValueError) as err:
        raise ControlError(f"{control} is unreadable: {err}") from None
    if not isinstance(record, dict):
        raise ControlError(f"{control} is unreadable: not a JSON object")
    for key, check in (("endpoint", lambda v: isinstance(v, str) and v.startswith("tcp://")),
                       ("secret", lambda v: isinstance(v, str) and v)):  # fmt: skip
        if key not in record:
            raise ControlError(f"{control} is unreadable: it has no {key!r}")
        if not check(record[key]):
            raise ControlError(f"{control} is unreadable: {key!r} is {record[key]!r}")
    if run_lock.holder(run_dir) is None:  # no driver holds the run: asking would only wait out the timeout
        raise ControlError(
            f"{run_dir} is not running: its {CONTROL_FILE} is stale (its driver was killed); `asyncrl up --resume "
            f"{run_dir}` continues the run"
        )
    return record


def stopping_note(run_dir: Path) -> str:
    """What control.json says of a stop in progress (`ControlServer.mark_stopping`), or ""."""
    try:
        stopping = json.loads((run_dir / CONTROL_FILE).read_text()).get("stopping")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(stopping, dict):
        return ""
    return f"after step {stopping.get('after_step')}, on {stopping.get('reason')}"


def request(run_dir: Path, cmd: str, timeout_s: float = 10.0, **fields: Any) -> dict[str, Any]:
    """Send one request to the driver of `run_dir`; the reply map, or ControlError naming what went wrong."""
    if len(fields.get("items", ())) > MAX_SET_ITEMS:
        raise ControlError(f"set takes at most {MAX_SET_ITEMS} key=value items, got {len(fields['items'])}")
    record = driver_record(run_dir)
    if isinstance(record.get("stopping"), dict):  # between its last step and its exit it answers nothing: said now
        raise RunStopping(f"the run {run_dir} is stopping ({stopping_note(run_dir)}; pid {record.get('pid', '?')}): "
                          "it answers no request until it has stopped")  # fmt: skip
    endpoint, secret = record["endpoint"], record["secret"]
    message = msgpack.packb({"v": PROTOCOL_VERSION, "cmd": cmd, "secret": secret, **fields}, use_bin_type=True)
    if len(message) > MAX_REQUEST_BYTES:  # the driver's socket drops it unanswered (MAXMSGSIZE)
        raise ControlError(f"the {cmd} request is {len(message):,} bytes; the driver takes at most "
                           f"{MAX_REQUEST_BYTES:,}")  # fmt: skip
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        socket.send(message)
        if not socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            driver = run_lock.holder(run_dir)
            stopping = stopping_note(run_dir)
            if driver is not None and stopping:
                raise ControlError(f"the run {run_dir} is stopping ({stopping}; pid {driver or '?'}): it answers "
                                   "no request until it has stopped")  # fmt: skip
            if driver is None and not (run_dir / CONTROL_FILE).exists():  # it stopped while we asked: its file is gone
                raise ControlError(f"the run {run_dir} has stopped (its driver exited while this request waited)")
            if driver is not None:  # alive, and between two answers: stopping its workers, a checkpoint, an eval
                raise ControlError(f"no answer from the driver of {run_dir} (pid {driver or '?'}) within "
                                   f"{timeout_s:.0f}s, though it runs: it is busy (stopping, writing a checkpoint, "
                                   "evaluating); try again")  # fmt: skip
            raise ControlError(
                f"no answer from the driver of {run_dir} at {endpoint} within {timeout_s:.0f}s: it is not running "
                f"(killed? then {run_dir / CONTROL_FILE} is stale; `asyncrl up --resume {run_dir}` continues the run)"
            )
        reply = msgpack.unpackb(socket.recv(), raw=False)
    except zmq.ZMQError as err:
        raise ControlError(f"cannot reach the driver of {run_dir} at {endpoint!r}: {err}") from None
    except (ValueError, msgpack.UnpackException) as err:
        raise ControlError(f"the driver of {run_dir} at {endpoint} sent a reply that is not msgpack: {err}") from None
    finally:
        socket.close(0)
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ControlError(f"unexpected reply from the driver of {run_dir} at {endpoint} (another version of "
                           f"asyncrl?): {str(reply)[:200]}")  # fmt: skip
    if not reply["ok"]:
        raise ControlError(str(reply.get("error", "refused")))
    missing = [key for key in REPLY_FIELDS.get(cmd, ()) if key not in reply]
    if missing:
        raise ControlError(f"unexpected reply from the driver of {run_dir} at {endpoint} (another version of "
                           f"asyncrl?): no {', '.join(missing)}")  # fmt: skip
    return reply


def format_status(status: dict[str, Any]) -> str:
    """A few human-readable lines of a status reply."""
    lines = [
        f"run {status['run']}: step {status['step']}/{status['steps']}, weight version {status['version']}"
        + (" (stopping)" if status.get("stopping") else ""),
    ]
    tput = status.get("throughput", {})
    stale = status.get("staleness", {})
    lines.append(
        f"throughput {tput.get('rollout_tok_s', 0):.0f} tok/s, {tput.get('step_s', 0):.2f} s/step; staleness mean "
        f"{stale.get('mean', float('nan'))} max {stale.get('max', float('nan'))} (max_lag {stale.get('max_lag')})"
    )
    buf = status.get("buffer", {})
    if "unavailable" in buf:
        lines.append(f"buffer: unavailable ({buf['unavailable']})")
    else:
        lines.append(
            f"buffer: {buf.get('queued_groups', '?')} groups queued, {buf.get('leased_groups', '?')} leased, "
            f"{buf.get('consumed_groups', '?')} consumed, {buf.get('dropped_stale', '?')} dropped stale"
        )
    lines.append(f"workers ({len(status.get('workers', []))}):")
    for row in status.get("workers", []):
        lines.append(
            f"  {row['worker']:<14} {row.get('state', ''):<12} pid {row.get('pid') or '-':<8} "
            f"version {row.get('version') if row.get('version') is not None else '-':<5} "
            f"samples {row.get('samples', 0)}  errors {row.get('errors', 0)}"
        )
    live = status.get("live", {})
    lines.append("live: " + ", ".join(f"{k}={v}" for k, v in live.items()))
    errors = status.get("errors", [])
    lines.append("recent errors: " + ("none" if not errors else ""))
    lines += [f"  {e}" for e in errors]
    return "\n".join(lines)
