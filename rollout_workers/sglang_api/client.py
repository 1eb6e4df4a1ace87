"""A thin client of SGLang's native HTTP API (real SGLang 0.5.x or `asyncrl serve`; shapes in protocol.py).

Every call is one HTTP request with a timeout. A refused or dropped connection, or an answer cut off, raises
`ServerUnavailable` (the backend's supervisor decides what to do), an answer not read within the timeout
`RequestTimedOut` (the server may still be running the request: abort it by its rid), an answer other than 2xx
`ServerError` with SGLang's message.
Sessions are per thread (requests' connection pools are not shared across threads).
"""

from __future__ import annotations

import threading
from typing import Any

import requests

from rollout_workers.sglang_api.protocol import PAUSE_MODES


class ServerUnavailable(ConnectionError):
    """The server did not answer (not running, restarting, or the connection dropped)."""


class RequestTimedOut(ServerUnavailable):
    """The server took the request but did not answer within the timeout; it may still be running it."""


class ServerError(RuntimeError):
    """The server answered with an error status; `status` and `body` are SGLang's."""

    def __init__(self, path: str, status: int, body: Any):
        message = body
        if isinstance(body, dict):
            message = (body.get("error") or {}).get("message") or body.get("message") or body.get("detail") or body
        super().__init__(f"{path}: HTTP {status}: {message}")
        self.status = status
        self.body = body


class SGLangClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str = ""):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.api_key = api_key
        """The server's `--api-key`: sent as `Authorization: Bearer` with every request ("" sends none)."""
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
        return session

    def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """One call; returns the decoded JSON body (or the text, or None when empty)."""
        try:
            response = self._session().request(
                method, self.base_url + path, json=body, timeout=timeout_s or self.timeout_s
            )
        except requests.ReadTimeout as err:
            self._local.session = None
            raise RequestTimedOut(f"{self.base_url}{path}: no answer in {timeout_s or self.timeout_s} s") from err
        except requests.RequestException as err:  # refused, dropped, or an answer cut off mid-body (a server killed
            self._local.session = None  # while it answered): a dropped connection poisons the pool, start afresh
            raise ServerUnavailable(f"{self.base_url}{path}: {type(err).__name__}: {err}") from err
        try:
            payload: Any = response.json() if response.content else None
        except ValueError:
            payload = response.text
        if response.status_code >= 300:
            raise ServerError(path, response.status_code, payload)
        return payload

    # ---- health and info --------------------------------------------------------------------------------------
    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self.request("GET", "/health", timeout_s=timeout_s)
        except (ServerUnavailable, ServerError):
            return False
        return True

    def model_info(self) -> dict[str, Any]:
        """GET /model_info (SGLang 0.5.9's name; `/get_model_info` is its deprecated alias)."""
        return self.request("GET", "/model_info")

    def weight_version(self) -> str:
        """The served weights' label, from /model_info (0.5.9 answers `/get_weight_version` with 404)."""
        return str(self.model_info()["weight_version"])

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, body: dict[str, Any]) -> Any:
        """POST /generate: a dict for one prompt, a list for a batch (or `n` > 1)."""
        return self.request("POST", "/generate", body)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def flush_cache(self) -> bool:
        try:
            self.request("POST", "/flush_cache")
        except ServerError as err:
            if err.status == 400:  # requests are running: SGLang refuses
                return False
            raise
        return True

    # ---- weight updates ---------------------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        self.request("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self.request("POST", "/continue_generation", {})

    def begin_weight_update(self) -> bool:
        """Open a weight-update session; False where the server predates the endpoint (SGLang before ~0.5.12)."""
        try:
            self.request("POST", "/begin_weight_update", {})
        except ServerError as err:
            if err.status == 404:
                return False
            raise
        return True

    def end_weight_update(self) -> None:
        self.request("POST", "/end_weight_update", {})

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}  # SGLang's default: True
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self.request("POST", "/update_weights_from_disk", body)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> dict[str, Any]:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return self.request("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self.request("POST", "/update_weights_from_distributed", body)
