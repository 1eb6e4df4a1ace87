"""`BufferClient`: the request/reply client of the buffer service, used by rollout workers, the learner and the CLI.

One DEALER socket, one request at a time, one client per thread (ZMQ sockets are not thread-safe). Each request
waits at most `timeout_s` (plus `wait_s` for `fetch_batch`) for its reply and otherwise raises `BufferUnavailable`;
the socket is then closed and recreated under a fresh routing id, so a late reply to the abandoned request can
never be taken for the answer to the next one. Routing ids are `<identity>/<random>` so that two clients with the
same identity never collide in the service's ROUTER.

A restarted buffer (the driver restarts a dead one on the same endpoint, asyncrl/supervise.py): a request in flight
when the connection drops (a socket monitor reports EVENT_DISCONNECTED; the reply, had it been sent, would already be
queued) is sent again, at most `MAX_RESENDS` times, on a fresh socket; ZMQ queues it until the new service listens.
Every request can be sent twice: a lease again leases (the lost one returns to the pool when the journal is
replayed), a push of a group already admitted is answered `duplicate`, and a FetchBatch for the step whose batch the
dead service consumed is answered with that same batch (`BufferService.redeliver`). `while_waiting`, if set, runs
between the `WAIT_SLICE_S` slices of a wait (the driver restarts its buffer there).

CurveZMQ: pass `curve=client_keys(cfg.buffer.curve_keys_dir)` (common/curve.py) when the buffer has keys. A client
with no key, a wrong server key or a key the buffer does not allow is refused at the handshake: its requests raise
`BufferUnavailable` after `timeout_s`, like a buffer that is down (ZMQ does not tell the client why).

`Heartbeat`: a thread with its own client that keeps a busy worker's leases alive (see buffer/state.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import zmq

from common import wire
from common.curve import ClientKeys
from common.wire import (
    BatchReply,
    ErrorReply,
    FetchBatch,
    LeaseReply,
    LeaseRequest,
    PromptLease,
    PushGroup,
    PushReply,
    SetMaxLag,
    StatsReply,
    StatsRequest,
    Trajectory,
    WorkerLeaving,
)

HWM = 1000
WAIT_SLICE_S = 0.1
"""A request's wait for its reply is cut in slices this long, to notice a dropped connection between them."""
MAX_RESENDS = 5
"""Most times one request is sent again after its connection dropped (a peer that keeps dropping it times out)."""
R = TypeVar("R")


class BufferUnavailable(TimeoutError):
    """The buffer did not answer in time (not running, overloaded, or unreachable)."""


class BufferRequestError(RuntimeError):
    """The buffer answered with an ErrorReply (the request was malformed or unexpected) or an unexpected type."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"buffer rejected the request: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.detail = detail


class BufferClient:
    """Typed calls to the buffer service at `endpoint` (e.g. "tcp://127.0.0.1:5555")."""

    def __init__(self, endpoint: str, identity: str, timeout_s: float = 30.0, curve: ClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.timeout_s = timeout_s
        self.curve = curve
        self.while_waiting: Callable[[], object] | None = None
        self.resends = 0  # requests sent again after a dropped connection, over this client's life
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._connect()

    def lease(self, max_groups: int) -> tuple[list[PromptLease], float]:
        """Lease up to `max_groups` prompts; returns (leases, retry_after_s)."""
        reply = self._request(LeaseRequest(worker=self.identity, max_groups=max_groups), LeaseReply)
        return reply.leases, reply.retry_after_s

    def heartbeat(self) -> None:
        """Tell the buffer this worker is alive (a LeaseRequest of 0 groups), so its leases are not returned."""
        self._request(LeaseRequest(worker=self.identity, max_groups=0), LeaseReply)

    def leave(self) -> None:
        """Tell the buffer this worker stops (WorkerLeaving): its unfinished leases return to the pool now, and it is
        not declared dead after `buffer.worker_timeout_s`."""
        self._request(WorkerLeaving(worker=self.identity), LeaseReply)

    def push_group(self, group: str, trajectories: list[Trajectory]) -> PushReply:
        """Push the finished group of a lease (see PushReply for the outcomes).

        `accepted=False, reason="backpressure"`: keep the group and push it again after a pause; another
        `accepted=False` reason (group_size, unknown_group, ...): the group is not admissible, drop it. A group that
        does not even decode (NaN log-probs, mismatched lengths, ...) raises BufferRequestError with the reason.
        """
        return self._request(PushGroup(worker=self.identity, group=group, trajectories=trajectories), PushReply)

    def fetch_batch(self, step: int, num_groups: int, wait_s: float) -> BatchReply:
        """Ask for `num_groups` admissible groups for train step `step`, waiting up to `wait_s` in the buffer
        (finite, in [0, wire.MAX_WAIT_S]; ValueError otherwise, before anything is sent)."""
        if not 0.0 <= wait_s <= wire.MAX_WAIT_S:  # NaN fails both comparisons
            raise ValueError(f"fetch_batch: wait_s must be in [0, {wire.MAX_WAIT_S}] seconds, got {wait_s!r}")
        request = FetchBatch(step=step, num_groups=num_groups, wait_s=wait_s)
        return self._request(request, BatchReply, extra_timeout_s=wait_s)

    def stats(self) -> dict[str, float | int]:
        return self._request(StatsRequest(), StatsReply).stats

    def set_max_lag(self, max_lag: int) -> dict[str, float | int]:
        """Change staleness.max_lag of the running buffer; returns its counters after the change."""
        return self._request(SetMaxLag(max_lag=max_lag), StatsReply).stats

    def close(self) -> None:
        if self._socket is not None:
            if self._monitor is not None:
                self._socket.disable_monitor()
                self._monitor.close(0)
                self._monitor = None
            self._socket.close(0)
            self._socket = None

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> None:
        self.close()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, HWM)
        socket.setsockopt(zmq.RCVHWM, HWM)
        socket.setsockopt(zmq.ROUTING_ID, f"{self.identity}/{uuid.uuid4().hex[:12]}".encode()[-255:])
        if self.curve is not None:
            socket.curve_secretkey = self.curve.secret
            socket.curve_publickey = self.curve.public
            socket.curve_serverkey = self.curve.server_public
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.connect(self.endpoint)
        self._socket = socket

    def _disconnected(self) -> bool:
        """Whether the connection dropped since the last look (the monitor's events are drained)."""
        if self._monitor is None or not self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the common case, cheap
            return False
        dropped = False
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            dropped = True
        return dropped

    def _request(self, msg: wire.Message, expected: type[R], extra_timeout_s: float = 0.0) -> R:
        if self._socket is None or self._disconnected():  # dropped while idle: start on a fresh connection
            self._connect()
        assert self._socket is not None
        timeout_s = self.timeout_s + extra_timeout_s
        data = wire.encode(msg)
        try:
            self._socket.send(data, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._connect()
            raise BufferUnavailable(f"buffer at {self.endpoint}: cannot send {type(msg).__name__}") from None
        try:
            reply = self._wait_reply(data, timeout_s)
        except BaseException:  # interrupted (KeyboardInterrupt) or an undecodable reply: the request is abandoned,
            self._connect()  # and its late reply must never be taken for the answer to the next request
            raise
        if reply is None:
            self._connect()  # the abandoned request and any late reply go away with the old socket
            hint = "" if self.curve is None else " (with CurveZMQ, also a sign of keys the buffer does not accept)"
            raise BufferUnavailable(
                f"buffer at {self.endpoint} did not answer {type(msg).__name__} within {timeout_s:.1f}s{hint}"
            )
        if isinstance(reply, ErrorReply):
            raise BufferRequestError(reply.reason, reply.detail)
        if not isinstance(reply, expected):
            self._connect()
            raise BufferRequestError("unexpected_reply", f"{type(reply).__name__} for {type(msg).__name__}")
        return reply

    def _wait_reply(self, data: bytes, timeout_s: float) -> wire.Message | None:
        """The reply to the request `data` just sent, or None after `timeout_s`; sent again on a fresh socket when
        the connection drops meanwhile (at most MAX_RESENDS times, within the same deadline)."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        resends = 0
        while True:
            assert self._socket is not None
            now = time.monotonic()
            if self._socket.poll(max(0, int(min(deadline - now, WAIT_SLICE_S) * 1000)), zmq.POLLIN):
                return wire.decode(self._socket.recv_multipart()[-1])
            if self._disconnected() and resends < MAX_RESENDS and not self._socket.poll(0, zmq.POLLIN):
                resends += 1
                self.resends += 1
                self._connect()  # queued by ZMQ until the (restarted) service accepts the connection
                # nowhere to queue it yet (a refused CurveZMQ handshake): as if unanswered, the next drop sends it
                # again, or the deadline gives up (`_request`: BufferUnavailable)
                with contextlib.suppress(zmq.Again):
                    self._socket.send(data, flags=zmq.NOBLOCK)
                continue
            if time.monotonic() >= deadline:
                return None
            if self.while_waiting is not None:
                self.while_waiting()


class Heartbeat:
    """A daemon thread that sends `BufferClient.heartbeat` for `identity` every `interval_s` while `alive()` holds.

    It has its own socket (ZMQ sockets are not thread-safe), so it keeps beating while the worker's own thread is
    busy generating a long batch. It stops when `alive()` turns false (the worker loop died: its leases should
    return) or on `stop()`. A heartbeat the buffer does not answer is skipped, not retried: the next one follows.
    """

    def __init__(
        self,
        endpoint: str,
        identity: str,
        interval_s: float,
        alive: Callable[[], bool] = lambda: True,
        curve: ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.interval_s = interval_s
        self.alive = alive
        self.curve = curve
        self.sent = 0
        self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{identity}-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5.0)

    def _run(self) -> None:
        with BufferClient(self.endpoint, self.identity, timeout_s=max(self.interval_s, 1.0), curve=self.curve) as c:
            while not self._stop.wait(self.interval_s) and self.alive():
                try:
                    c.heartbeat()
                    self.sent += 1
                except BufferUnavailable:
                    self.missed += 1
                except Exception:  # an ErrorReply, an undecodable answer: skipped like a missed one, never fatal
                    self.missed += 1  # (a dead heartbeat thread would let a busy worker's leases expire)
