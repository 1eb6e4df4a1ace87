"""The buffer service process: `python -m buffer --config-json FILE --run-dir DIR`.

One ZMQ ROUTER socket and a single-threaded poll loop over `BufferState`:

    rollout workers ──LeaseRequest / PushGroup──▶ ┌──────────────┐ ◀──FetchBatch── learner
                    ◀──LeaseReply / PushReply──── │ ROUTER, poll │ ──BatchReply──▶ (parked until enough
                                                  └──────────────┘                  groups or wait_s passed)
                                                   BufferState + journal (DIR/buffer.journal)

| waits in the loop | what unblocks it |
|---|---|
| a parked FetchBatch | a PushGroup that fills the batch, or its `wait_s` deadline (then `ready=False`) |
| a leased prompt | its PushGroup, or `lease_timeout_s` (then the prompt is leased again, first) |
| rollout throttled (empty LeaseReply) | a FetchBatch for a later step, dropped or filtered groups |

Socket rules: the ROUTER binds `tcp://{buffer.host}:{buffer.port}` (port 0: a free port), linger 0, send and receive
high-water marks of `HWM` messages, ROUTER_MANDATORY so a reply to a vanished peer raises instead of vanishing (an
undelivered batch goes back to the head of the queue). A request is one frame from a DEALER; any envelope frames
before it (a REQ peer's empty delimiter) are sent back unchanged. Readiness: after binding, exactly one stdout
line `READY tcp://HOST:PORT` (a wildcard host is advertised as this node's address). Every reply is sent after the
journal records of its request are committed: the loop starts one commit (write and fsync, in the journal's
writer thread) for all the requests it drained, goes on serving, and sends their replies when the commit is durable
(`buffer/journal.py`); a BatchReply waits for every earlier commit. A malformed request gets an ErrorReply and is
counted as `rejected_<reason>`; nothing a peer sends stops the service.
SIGTERM / SIGINT: commit the journal and exit 0.

Restart after a crash (the driver restarts a dead buffer on the same run directory and port with `--redeliver`,
asyncrl/supervise.py): the journal is replayed (leases never resolved return to the pool), and the batch of the last
consumed step is kept as `redeliver`: a FetchBatch for that step (the learner never got the reply) is answered with
the same groups, once; a FetchBatch for a later step forgets it. Clients send their request in flight again
(buffer/client.py).

Security: with `buffer.curve_keys_dir` the ROUTER is a CurveZMQ server and a ZAP handler thread admits only the
allow-listed client keys (common/curve.py); a refused handshake never reaches the loop and is counted as
`rejected_handshakes`. Without keys the socket is plain ZMQ, which BufferConfig allows only on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from buffer import ingest, recovery
from buffer.ingest import CheckedPush
from buffer.journal import Journal, intact_records, read_records
from buffer.launcher import EXIT_JOURNAL_UNWRITABLE
from buffer.memory import configure_malloc, reserve
from buffer.selective import PromptHistory, SkipRule
from buffer.state import BufferState, Queued, batch_reply
from common import config as cfgmod
from common import wire
from common.config_rules import skip_zero_variance_on
from common.curve import CurveKeyError, ServerKeys, server_keys
from common.netaddr import bind
from common.run_files import checkpoint_steps
from common.tasks import make_source
from common.wire import (
    ErrorReply,
    FetchBatch,
    LeaseReply,
    LeaseRequest,
    PushReply,
    SetMaxLag,
    StatsReply,
    StatsRequest,
    WorkerLeaving,
)

HWM = 10000
POLL_MS = 50
MAX_PARKED = 64
"""Most FetchBatch requests parked at once; another is refused (`rejected_oversized`)."""
MAX_ENVELOPE_FRAMES = 8
MAX_ENVELOPE_BYTES = 4096
"""A request whose routing envelope (the frames before the payload) is larger is dropped and counted as
`rejected_bad_envelope`: a parked fetch keeps its envelope until answered."""
EXPIRY_CHECK_S = 0.02
FETCH_REISSUE_GRACE_S = 1.0
"""A FetchBatch answered empty at its deadline still counts as waiting (`waiting_fetches`) this long, or until its
peer asks again: the learner's fetch loop asks again at once, and a stats request in between (the watchdog's) would
otherwise see no fetch waiting and report the learner as busy."""
JOURNAL_NAME = "buffer.journal"
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
COMPACT_BYTES = 64 * 1024 * 1024
"""Default journal size that triggers compaction (config `buffer.compact_bytes`)."""


@dataclass(slots=True)
class ServiceConfig:
    """The config sections the buffer reads."""

    buffer: cfgmod.BufferConfig
    staleness: cfgmod.StalenessConfig
    train: cfgmod.TrainConfig
    algo: cfgmod.AlgoConfig
    data: cfgmod.DataConfig
    checkpoint: cfgmod.CheckpointConfig  # `every`: what a compaction keeps for a resume (recovery.keep_from)


_SECTIONS = {
    "buffer": cfgmod.BufferConfig,
    "staleness": cfgmod.StalenessConfig,
    "train": cfgmod.TrainConfig,
    "algo": cfgmod.AlgoConfig,
    "data": cfgmod.DataConfig,
    "checkpoint": cfgmod.CheckpointConfig,
}


def load_service_config(values: dict[str, Any]) -> ServiceConfig:
    """Rebuild the sections the buffer needs from `common.config.to_dict` output; other sections are ignored.

    Raises ConfigError naming the key on unknown keys, wrong types, invalid choices or out-of-range values (the
    config's own checks, `common.config.check_section`; the rules that span other sections were checked when the
    driver loaded the config).
    """
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        try:
            merged = OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(values.get(name) or {}))
            sections[name] = OmegaConf.to_object(merged)
        except OmegaConfBaseException as err:
            raise cfgmod.ConfigError(f"{name}.{getattr(err, 'full_key', '?')}: {str(err).splitlines()[0]}") from err
        cfgmod.check_section(sections[name], f"{name}.")  # the choices and ranges declared with each field
    return ServiceConfig(**sections)


@dataclass(slots=True)
class _Parked:
    envelope: list[bytes]
    request: FetchBatch
    deadline: float  # time.monotonic()
    dropped: int


class BufferService:
    """The poll loop: decode, dispatch to BufferState, commit the journal, reply."""

    def __init__(
        self,
        state: BufferState,
        socket: zmq.Socket,
        journal: Journal | None,
        compact_bytes: int = COMPACT_BYTES,
        redeliver: tuple[int, list[Queued]] | None = None,
        keep_from: Callable[[int], int] | None = None,
    ) -> None:
        self.state = state
        # current step -> the first step whose consumed groups a compaction keeps (recovery.keep_from); None: none
        self.keep_from = keep_from
        self.redeliver = redeliver  # (step, groups) consumed before a crash, maybe never received (module doc)
        self.socket = socket
        self.journal = journal
        self.compact_bytes = compact_bytes
        self._compact_at = max(compact_bytes, 2 * journal.size_bytes()) if journal is not None else 0
        self.parked: list[_Parked] = []
        self.expired_fetches: dict[tuple[bytes, ...], float] = {}  # envelope -> when its fetch was answered empty
        self.outbox: list[list[bytes]] = []  # replies to requests whose journal records are not committed yet
        self.syncing: deque[tuple[int, list[bytes]]] = deque()  # (commit_async seq, reply) waiting for the disk
        self.stopping = False
        self._next_expiry_check = 0.0

    def run(self, monitor: zmq.Socket | None = None) -> None:
        """Serve until `stopping`; `monitor`: the socket's handshake-failure events (CurveZMQ), counted."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        if self.journal is not None:
            poller.register(self.journal.ready_fd, zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(self._poll_timeout_ms()))
            if monitor is not None and monitor in events:
                self._count_handshake_failures(monitor)
            if self.journal is not None and self.journal.ready_fd in events:
                self._send_durable()  # drains the fd too, or the poll would return at once from now on
            if self.socket in events:
                for _ in range(1000):  # drain what is ready, then do the timed work
                    request = self._recv()
                    if request is None:
                        break
                    self._on_frames(*request)
                self._flush_async()  # one journal commit (fsync) for every request drained above
            self._timed_work()
            self._maybe_compact()

    def _recv(self) -> tuple[list[bytes], memoryview] | None:
        """The next request if one is ready: (envelope frames, a view of the last frame, not copied), else None.

        `recv_multipart` by hand: the small envelope frames are copied into bytes, the payload frame is kept as
        received. A one-frame message (no envelope), or one whose envelope is beyond MAX_ENVELOPE_FRAMES /
        MAX_ENVELOPE_BYTES, comes back as ([], payload) for `_on_frames` to count."""
        socket = self.socket
        try:
            frame = socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        envelope: list[bytes] = []
        envelope_bytes, oversized = 0, False
        while socket.getsockopt(zmq.RCVMORE):  # the frames of one message arrive together: no Again from here
            envelope_bytes += len(frame)
            oversized = oversized or len(envelope) >= MAX_ENVELOPE_FRAMES or envelope_bytes > MAX_ENVELOPE_BYTES
            if not oversized:
                envelope.append(frame.bytes)
            frame = socket.recv(zmq.NOBLOCK, copy=False)
        return ([] if oversized else envelope), frame.buffer  # no envelope: counted as rejected_bad_envelope

    def _count_handshake_failures(self, monitor: zmq.Socket) -> None:
        """A peer without the right keys never gets a message through; each refused handshake is counted."""
        while True:
            try:
                recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.state.counters["rejected_handshakes"] += 1

    def _poll_timeout_ms(self) -> int:
        timeout = POLL_MS / 1000
        if self.parked:
            timeout = min(timeout, min(p.deadline for p in self.parked) - time.monotonic())
        return max(0, int(timeout * 1000))

    def _timed_work(self) -> None:
        now = time.monotonic()
        if now >= self._next_expiry_check:
            self._next_expiry_check = now + EXPIRY_CHECK_S
            if self.state.expire_leases():
                self._commit()
        for parked in [p for p in self.parked if p.deadline <= now]:
            self.parked.remove(parked)
            groups, dropped = self.state.take_batch(parked.request.step, parked.request.num_groups)
            if groups is None:
                self.expired_fetches[tuple(parked.envelope)] = now
            self._send_batch(parked.envelope, parked.request.step, groups, parked.dropped + dropped)
        self._forget_expired_fetches(now)

    def _maybe_compact(self) -> None:
        """Rewrite the journal as a snapshot once it is past `compact_bytes` and twice its last compacted size, and
        at least half of it is garbage: a snapshot of a queue (and of the consumed groups a resume could train again,
        `keep_from`) that holds most of the journal would only copy it."""
        if self.journal is None:  # nothing a resume could train again: keep only the batch in flight's (`requeue`)
            self.state.prune_consumed(self.state.step)
            return
        if self.journal.size_bytes() < self._compact_at:
            return
        size = self.journal.size_bytes()
        kept_from = self.keep_from(self.state.step) if self.keep_from is not None else self.state.step + 1
        self.state.prune_consumed(kept_from)
        if 2 * (self.state.queued_bytes() + self.state.kept_bytes()) > size:
            self._compact_at = size + self.compact_bytes // 4  # look again once the journal has grown some more
            return
        self._flush()
        wanted = list(self.state.consumed_log)
        kept_from, kept = recovery.kept_payloads(intact_records(self.journal.path), wanted, kept_from)
        self.journal.rewrite(recovery.snapshot(self.state, kept, kept_from))
        self.state.prune_consumed(kept_from)
        self.state.counters["journal_compactions"] += 1
        self._compact_at = max(self.compact_bytes, 2 * self.journal.size_bytes())

    def _on_frames(self, envelope: list[bytes], payload: memoryview) -> None:
        """One request: `envelope` (routing id, ...) and the payload, a view of the received frame (not copied)."""
        if not envelope:  # a ROUTER always prepends the identity; nothing to answer otherwise
            self.state.counters["rejected_bad_envelope"] += 1
            return
        try:
            reply = self._handle(envelope, payload)
            data = None if reply is None else _encode_reply(reply)  # None: parked, or a batch already sent
        except wire.WireError as err:
            self.state.counters[f"rejected_{err.reason}"] += 1
            data = _encode_reply(ErrorReply(err.reason, err.detail))
        except Exception as err:  # process boundary: a bug must not take the buffer down; count it and say so
            traceback.print_exc(file=sys.stderr)
            self.state.counters["rejected_internal_error"] += 1
            data = _encode_reply(ErrorReply("internal_error", f"{type(err).__name__}: {err}"[:500]))
        if data is not None:
            self.outbox.append([*envelope, data])

    def _handle(self, envelope: list[bytes], payload: memoryview) -> wire.Message | None:
        msg = ingest.decode_request(payload)
        state = self.state
        if type(msg) is CheckedPush:  # the most frequent request first
            reply = state.push(msg)
            if self.parked and reply.accepted and reply.reason == "":
                self._serve_parked()
            return reply
        if isinstance(msg, LeaseRequest):
            return state.lease(msg.worker, msg.max_groups)
        if isinstance(msg, WorkerLeaving):
            state.leave(msg.worker)
            return LeaseReply(leases=[], retry_after_s=0.0)
        if isinstance(msg, FetchBatch):
            if not 1 <= msg.num_groups <= wire.MAX_GROUP:  # a BatchReply holds at most MAX_GROUP groups
                raise wire.WireError("bad_field", f"FetchBatch.num_groups must be in [1, {wire.MAX_GROUP}]")
            if self.redeliver is not None and msg.step >= self.redeliver[0]:
                (step, again), self.redeliver = self.redeliver, None
                if msg.step == step and msg.num_groups == len(again):  # its reply was lost with the dead service
                    state.counters["redelivered_groups"] += len(again)
                    self._send_batch(envelope, step, again, 0)
                    return None
            taken, dropped = state.take_batch(msg.step, msg.num_groups)
            if taken is not None or msg.wait_s <= 0:
                self._send_batch(envelope, msg.step, taken, dropped)
                return None
            self.parked = [p for p in self.parked if p.envelope != envelope]  # a peer asks one thing at a time
            self.expired_fetches.pop(tuple(envelope), None)
            if len(self.parked) >= MAX_PARKED:
                raise wire.WireError("oversized", f"{MAX_PARKED} FetchBatch requests are waiting already")
            self.parked.append(_Parked(envelope, msg, time.monotonic() + msg.wait_s, dropped))
            return None
        if isinstance(msg, StatsRequest):
            return StatsReply(self.stats())
        if isinstance(msg, SetMaxLag):
            state.set_max_lag(msg.max_lag)
            print(f"buffer: staleness.max_lag set to {msg.max_lag}", file=sys.stderr, flush=True)
            return StatsReply(self.stats())
        raise wire.WireError("unexpected_type", f"the buffer does not serve {type(msg).__name__}")

    def _serve_parked(self) -> None:
        """Answer every parked fetch that can be filled now, oldest first; one that cannot (more groups than are
        queued) does not hold up the others."""
        for parked in list(self.parked):
            if len(self.state.queue) < parked.request.num_groups:
                continue  # cannot be filled: skipped without take_batch's pass over the queue (once per push)
            groups, dropped = self.state.take_batch(parked.request.step, parked.request.num_groups)
            parked.dropped += dropped
            if groups is None:
                continue
            self.parked.remove(parked)
            self._send_batch(parked.envelope, parked.request.step, groups, parked.dropped)

    def _send_batch(self, envelope: list[bytes], step: int, taken: list[Queued] | None, dropped: int) -> None:
        try:
            data = batch_reply(step, taken, dropped)
        except wire.WireError as err:  # too large for one message: the groups go back, the learner is told why
            if taken:
                self.state.requeue(taken)
            self.state.counters[f"rejected_{err.reason}"] += 1
            detail = f"a BatchReply of {len(taken or [])} groups: {err.detail}; fetch fewer groups per step"
            data, taken = _encode_reply(ErrorReply(err.reason, detail)), None
        self._flush()  # commits the consume record (and the requeue) too
        if not self._send([*envelope, data]) and taken:
            self.state.requeue(taken)  # the learner never got it: it was not trained
            self._commit()

    def _flush(self) -> None:
        """Commit the journal, then send every reply that waited for it."""
        self._commit()
        replies = [frames for _, frames in self.syncing] + self.outbox
        self.syncing.clear()
        self.outbox = []
        for frames in replies:
            self._send(frames)

    def _flush_async(self) -> None:
        """Start the journal commit of the requests handled so far; their replies go out once it is durable
        (`_send_durable`), while the loop goes on admitting what arrives meanwhile."""
        if self.journal is None:
            self._flush()
            return
        seq = self.journal.commit_async()
        self.syncing.extend((seq, frames) for frames in self.outbox)
        self.outbox = []
        self._send_durable()

    def _send_durable(self) -> None:
        assert self.journal is not None
        durable = self.journal.durable()
        while self.syncing and self.syncing[0][0] <= durable:
            self._send(self.syncing.popleft()[1])

    def _send(self, frames: list[bytes]) -> bool:
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as err:  # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            self.state.counters["reply_send_failures"] += 1
            print(f"buffer: reply not delivered: {err}", file=sys.stderr, flush=True)
            return False
        return True

    def _commit(self) -> None:
        if self.journal is not None:
            self.journal.commit()

    def stats(self) -> dict[str, float | int]:
        out = self.state.stats()
        out["parked_fetches"] = len(self.parked)
        self._forget_expired_fetches(time.monotonic())
        out["waiting_fetches"] = len(self.parked) + len(self.expired_fetches)
        return out

    def _forget_expired_fetches(self, now: float) -> None:
        if self.expired_fetches:  # bounded by the peers that fetched within the grace
            self.expired_fetches = {k: t for k, t in self.expired_fetches.items() if now - t < FETCH_REISSUE_GRACE_S}


_PUSH_REPLIES: dict[tuple[bool, str], bytes] = {}
"""Encoded PushReplies by (accepted, reason): BufferState answers a push with one of a few fixed reasons."""


def _encode_reply(reply: wire.Message) -> bytes:
    """wire.encode, with each possible PushReply (one per pushed group) encoded once."""
    if type(reply) is not PushReply:
        return wire.encode(reply)
    key = (reply.accepted, reply.reason)
    data = _PUSH_REPLIES.get(key)
    if data is None:
        data = _PUSH_REPLIES[key] = wire.encode(reply)
    return data


def make_socket(context: zmq.Context, curve: ServerKeys | None = None) -> zmq.Socket:
    """The service's ROUTER (socket rules in the module docstring); a CURVE server if `curve` is given.

    With `curve`, start the authenticator (`start_authenticator`) before binding, or every client is refused.
    """
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, HWM)
    socket.setsockopt(zmq.RCVHWM, HWM)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    if curve is not None:
        socket.curve_secretkey = curve.secret
        socket.curve_publickey = curve.public
        socket.curve_server = True
    return socket


def start_authenticator(context: zmq.Context, curve: ServerKeys) -> ThreadAuthenticator:
    """The ZAP handler (a thread of this process) that admits only the client public keys in `curve.allowed_dir`."""
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(curve.allowed_dir))
    return auth


LOCK_NAME = "buffer.lock"
LOCK_WAIT_S = 15.0
"""How long a starting buffer waits for one that is stopping (a driver killed a moment ago) to release the run."""


def _lock_run_dir(run_dir: Path) -> Any:
    """An exclusive lock on the run's journal (two buffers appending to one journal would corrupt it): the open
    lock file, or None if another process still holds it after LOCK_WAIT_S."""
    import fcntl

    handle = open(run_dir / LOCK_NAME, "a+")  # noqa: SIM115 - kept open (and locked) for the process's lifetime
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                return None
            time.sleep(0.1)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m buffer", description=__doc__.splitlines()[0])
    parser.add_argument("--config-json", required=True, help="JSON of common.config.to_dict(cfg)")
    parser.add_argument("--run-dir", required=True, help="run directory (holds buffer.journal)")
    parser.add_argument("--resume-step", type=int, default=None,
                        help="resuming a learner checkpoint whose next train step is this: rewind the replayed "
                             "journal to it (buffer.recovery.rewind)")  # fmt: skip
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="the model's vocab_size: pushed token ids at or past it are refused (0: unchecked)",
    )
    parser.add_argument("--redeliver", action="store_true",
                        help="restarted under a running learner (asyncrl/supervise.py): answer a FetchBatch for the "
                             "last consumed step with the batch it consumed (buffer.recovery.redelivery)")  # fmt: skip
    return parser.parse_args(argv)


def _open_journal(state: BufferState, path: Path, fsync: str, resume_step: int | None) -> Journal:
    """Replay the journal at `path` into `state`, attach it for appending, and rewind to `resume_step` if given."""
    records = read_records(path)
    recovery.replay(state, records)
    state.counters["replayed_records"] = len(records)
    state.counters["replayed_leases"] = len(state.returned)
    journal = state.journal = Journal(path, fsync)
    if records:
        print(
            f"buffer: replayed {len(records)} journal records: {len(state.queue)} groups queued, "
            f"{len(state.returned)} leases returned, cursor {state.cursor}, step {state.step}",
            file=sys.stderr,
            flush=True,
        )
    if resume_step is not None:
        recovery.check_covers(state, resume_step, path, checkpoint_steps(path.parent))
        rewound = recovery.rewind(state, resume_step)
        journal.commit()
        print(f"buffer: rewound to train step {resume_step}: {rewound}", file=sys.stderr, flush=True)
    return journal


def _serve(
    buffer_cfg: cfgmod.BufferConfig,
    curve: ServerKeys | None,
    state: BufferState,
    journal: Journal | None,
    redeliver: tuple[int, list[Queued]] | None = None,
    keep_from: Callable[[int], int] | None = None,
) -> int:
    """Bind, print READY, and serve until SIGTERM / SIGINT (0) or a journal write error (3); then close everything."""
    context = zmq.Context()
    auth = start_authenticator(context, curve) if curve is not None else None
    socket = make_socket(context, curve)
    monitor = socket.get_monitor_socket(HANDSHAKE_FAILURES) if curve is not None else None
    service = BufferService(state, socket, journal, buffer_cfg.compact_bytes, redeliver, keep_from)

    def stop(signum: int, frame: object) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        endpoint = bind(socket, buffer_cfg.host, buffer_cfg.port)
        print(f"READY {endpoint}", flush=True)
        service.run(monitor)
    except OSError as err:  # the journal cannot be written (disk full, I/O error): no durability, so stop
        print(f"buffer: stopping: the journal {journal.path if journal else ''} cannot be written ({err}); every "
              "acknowledged group is in it, restart once the disk is fixed", file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_JOURNAL_UNWRITABLE
    finally:
        if journal is not None:
            with contextlib.suppress(OSError):  # already reported; the sockets must still be closed
                journal.close()
        if monitor is not None:
            socket.disable_monitor()
            monitor.close(0)
        socket.close(0)
        if auth is not None:
            auth.stop()
        context.term()
    return 0


def _prompt_history(algo: cfgmod.AlgoConfig, seed: int) -> PromptHistory | None:
    """Selective rollout's state when `algo.skip_zero_variance` is on (null: with `algo.filter_groups`), else None."""
    if not skip_zero_variance_on(algo):
        return None
    return PromptHistory(SkipRule(base=algo.skip_base, min_prob=algo.skip_min_prob), seed)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_service_config(json.loads(Path(args.config_json).read_text()))
    except (OSError, ValueError) as err:
        print(f"buffer: bad config {args.config_json}: {err}", file=sys.stderr)
        return 2
    try:
        curve = server_keys(cfg.buffer.curve_keys_dir)
    except CurveKeyError as err:
        print(f"buffer: {err}", file=sys.stderr)
        return 2

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_run_dir(run_dir)  # held until this process exits
    if lock is None:
        print(f"buffer: another buffer process is using {run_dir} (it holds {LOCK_NAME}); stop it first",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"buffer: {configure_malloc()}, {reserve(cfg.buffer.reserve_mb << 20)}", file=sys.stderr, flush=True)
    state = BufferState(
        source=make_source(cfg.data),
        group_size=cfg.train.group_size,
        groups_per_step=cfg.train.groups_per_step,
        max_lag=cfg.staleness.max_lag,
        filter_groups=cfg.algo.filter_groups,
        lease_timeout_s=cfg.buffer.lease_timeout_s,
        max_queued_groups=cfg.buffer.max_queued_groups,
        worker_timeout_s=cfg.buffer.worker_timeout_s,
        seed=cfg.data.seed,
        history=_prompt_history(cfg.algo, cfg.data.seed),
        vocab_size=args.vocab_size,
    )
    journal: Journal | None = None
    redeliver = None
    if cfg.buffer.journal:
        try:
            journal = _open_journal(state, run_dir / JOURNAL_NAME, cfg.buffer.fsync, args.resume_step)
        except recovery.JournalBehind as err:
            print(f"buffer: {err}", file=sys.stderr)
            return 2
        if args.redeliver and args.resume_step is None:
            redeliver = recovery.redelivery(state)
    elif args.resume_step is not None:
        print("buffer: --resume-step needs buffer.journal=true", file=sys.stderr)
        return 2
    every = cfg.checkpoint.every

    def keep_from(step: int) -> int:
        return recovery.keep_from(checkpoint_steps(run_dir), every, step)

    return _serve(cfg.buffer, curve, state, journal, redeliver, keep_from)
