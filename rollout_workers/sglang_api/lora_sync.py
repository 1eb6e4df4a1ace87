"""LoRA for `rollout.backend: sglang` (`model.lora.rank > 0`): adapters go to the server through SGLang's LoRA API.

    stage_weights(v) ─ split ─┬─ the base (once, or when a new base is pinned) ──> the backend's base checkpoint,
                              │    loaded with /update_weights_from_disk as any full version (backend.py)
                              └─ the adapters of v ──> peft directory `lora-v<v>/` (adapter_config.json,
                                   adapter_model.safetensors) beside the backend's checkpoints
    sync thread ── /load_lora_adapter {"lora_name": "v<v>", "lora_path": dir} ──> the newest adapter (no pause)
    a sample ── acquire(): the newest loaded adapter ── /generate {"lora_path": "v<v>"} ── release()
    sync thread ── /unload_lora_adapter for adapters outside the newest `max_lag + 1` that no sample uses; dir removed

| who | waits for | unblocked by |
|---|---|---|
| a sample | an adapter loaded on the server (the backend's readiness) | the sync thread's first load |
| sync thread | a newer adapter written, or an old one released | stage_weights, release (polled every 0.5 s) |

Every token of one `/generate` call comes from the adapter named in it, so a segment's tokens carry that adapter's
version exactly (SGLang keeps a request on its adapter; it unloads one only once no request uses it). A sample
resubmitted after an abort picks the newest adapter again. Versions stay loaded while in use and while among the
newest `staleness.max_lag + 1` (TRL #7017: a serving engine must pin `max_staleness + 1` versions), so no request
is ever refused for an adapter gone under it.

Server flags (`lora_server_flags`): `--enable-lora --max-lora-rank r --lora-target-modules <model.lora.targets>`,
SGLang 0.5.x's names (`server_args.py`), which `asyncrl serve` takes too. The adapters written here are those the
learner published, for the base it published (UAQ-reparametrized, quantized): the server's base is that published
base (version 0 through `/update_weights_from_disk`), never the original model directory.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quant_sync.export import LORA_A, LORA_B, LORA_SCALING
from quant_sync.update import WeightUpdate

if TYPE_CHECKING:
    from common.config import LoraConfig
    from rollout_workers.sglang_api.client import SGLangClient

ADAPTER_DIR_PREFIX = "lora-v"
"""Adapter directories under the backend's root: `lora-v<version>` (the backend prunes only `v*` checkpoints)."""
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (LORA_A, LORA_B, LORA_SCALING)


def adapter_name(version: int) -> str:
    """The adapter's `lora_name` on the server (requests name it in `lora_path`): `v<version>`."""
    return f"v{version}"


def lora_server_flags(lora: LoraConfig) -> list[str]:
    """SGLang's launch flags for dynamic LoRA loading: no adapter at start, so rank and targets must be given."""
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *lora.targets]


def split_update(update: WeightUpdate) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base tensors, adapter tensors) of a published LoRA version (the subscriber completes adapter-only versions
    with their pinned base, so every version has both)."""
    base, adapters = {}, {}
    for name, tensor in update.tensors.items():
        (adapters if name.endswith(LORA_SUFFIXES) else base)[name] = tensor
    return base, adapters


def write_adapter_dir(directory: str | Path, adapters: dict[str, torch.Tensor], base_model: str) -> Path:
    """Write published adapters (`<linear>.lora_A` (r, in), `.lora_B` (out, r), `.lora_scaling` (1,)) as a peft LoRA
    directory (`lora_alpha = scaling * r`, so `alpha / r` gives the published scaling back exactly); atomically
    (under a temporary name, then renamed). Raises ValueError naming what does not fit one peft LoraConfig."""
    target = Path(directory)
    modules = sorted({name[: -len(suffix)] for name in adapters for suffix in LORA_SUFFIXES if name.endswith(suffix)})
    if not modules:
        raise ValueError("no LoRA tensors (<linear>.lora_A, .lora_B, .lora_scaling) in this version")
    tensors: dict[str, torch.Tensor] = {}
    ranks, scalings = set(), set()
    for module in modules:
        parts = [adapters.get(module + suffix) for suffix in LORA_SUFFIXES]
        if any(part is None for part in parts):
            raise ValueError(f"{module}: LoRA needs {', '.join(LORA_SUFFIXES)} together")
        a, b, scaling = parts
        ranks.add(int(a.shape[0]))  # type: ignore[union-attr]
        scalings.add(float(scaling.reshape(-1)[0]))  # type: ignore[union-attr]
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.to(torch.float32).contiguous()  # type: ignore[union-attr]
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.to(torch.float32).contiguous()  # type: ignore[union-attr]
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValueError(f"adapters of ranks {sorted(ranks)} and scalings {sorted(scalings)}: one peft LoraConfig "
                         "needs one rank and one alpha")  # fmt: skip
    (rank,), (scaling,) = ranks, scalings
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": scaling * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    from safetensors.torch import save_file

    temporary = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    (temporary / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    save_file(tensors, str(temporary / ADAPTER_FILE), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    temporary.rename(target)
    return target


def _call_tolerating(client: SGLangClient, path: str, body: dict[str, Any], done_phrase: str) -> None:
    """POST `body`; a 400 saying `done_phrase` means an earlier attempt already did it (its answer was lost)."""
    from rollout_workers.sglang_api.client import ServerError

    try:
        client.request("POST", path, body)
    except ServerError as err:
        if err.status != 400 or done_phrase not in str(err):
            raise


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter version as a sample holds it: its version (the tokens' tag) and its name on the server."""

    version: int
    name: str


class AdapterVersions:
    """The backend's LoRA state: adapter directories written, adapters loaded on the server, samples using them.

    Thread-safe: `stage` runs on the subscriber's thread, `acquire` / `release` on the sampling threads, `sync` and
    `forget_loaded` on the backend's sync thread."""

    def __init__(self, root: Path, base_model: str, max_lag: int):
        self.root = root
        self.base_model = base_model
        self.keep = max_lag + 1
        """Adapter versions kept loaded (the newest ones), used or not."""
        self._lock = threading.Lock()
        self._written: dict[int, Path] = {}  # version -> directory, loaded or not
        self._loaded: list[int] = []  # versions loaded on the server, oldest first
        self._in_use: Counter[int] = Counter()
        self._base: dict[str, torch.Tensor] | None = None  # the base last handed to the backend (held: ids stay valid)
        self.metrics = {"lora_loads": 0, "lora_unloads": 0, "lora_loaded": 0}

    # ---- the subscriber's thread ----------------------------------------------------------------------------------
    def stage(self, update: WeightUpdate) -> WeightUpdate | None:
        """Write `update`'s adapters as `lora-v<version>/`; returns the base as a full version to load when it is not
        the base handed over before (the first version, or a newly pinned base), else None."""
        base, adapters = split_update(update)
        path = write_adapter_dir(self.root / f"{ADAPTER_DIR_PREFIX}{update.version}", adapters, self.base_model)
        with self._lock:
            self._written[update.version] = path
            same = self._base is not None and self._base.keys() == base.keys()
            if same and all(self._base[name] is tensor for name, tensor in base.items()):  # type: ignore[index]
                return None
            self._base = base
        return WeightUpdate(update.version, base, update.scheme)

    # ---- the sampling threads -------------------------------------------------------------------------------------
    def acquire(self) -> Adapter | None:
        """The newest loaded adapter, counted as in use until `release`; None when none is loaded."""
        with self._lock:
            if not self._loaded:
                return None
            version = self._loaded[-1]
            self._in_use[version] += 1
        return Adapter(version, adapter_name(version))

    def release(self, adapter: Adapter) -> None:
        with self._lock:
            self._in_use[adapter.version] -= 1
            if self._in_use[adapter.version] <= 0:
                del self._in_use[adapter.version]

    # ---- the sync thread -------------------------------------------------------------------------------------------
    @property
    def newest_loaded(self) -> int | None:
        with self._lock:
            return self._loaded[-1] if self._loaded else None

    def has_work(self) -> bool:
        """Whether `sync` would load or unload anything."""
        with self._lock:
            return self._pending() is not None or bool(self._prunable())

    def sync(self, client: SGLangClient, min_version: int = -1) -> int | None:
        """Load the newest written adapter (at least `min_version`: the base loaded) if it is newer than the loaded
        ones, then unload what is neither among the newest `keep` nor in use; returns the newest loaded version."""
        with self._lock:
            pending = self._pending(min_version)
        if pending is not None:
            version, path = pending
            _call_tolerating(client, "/load_lora_adapter", {"lora_name": adapter_name(version), "lora_path": str(path)},
                             "already loaded")  # fmt: skip
            with self._lock:
                self._loaded.append(version)
                self.metrics["lora_loads"] += 1
        with self._lock:
            prunable = self._prunable()
        for version in prunable:
            _call_tolerating(client, "/unload_lora_adapter", {"lora_name": adapter_name(version)}, "does not exist")
            with self._lock:
                self._loaded.remove(version)
                path = self._written.pop(version, None)
                self.metrics["lora_unloads"] += 1
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
        with self._lock:
            self._drop_unloaded_dirs()
            self.metrics["lora_loaded"] = len(self._loaded)
            return self._loaded[-1] if self._loaded else None

    def forget_loaded(self) -> None:
        """The server was (re)launched: it holds no adapter; the newest written one is loaded again by `sync`."""
        with self._lock:
            self._loaded.clear()

    def close(self) -> None:
        with self._lock:
            for path in self._written.values():
                shutil.rmtree(path, ignore_errors=True)
            self._written.clear()
            self._base = None

    # ---- under the lock ---------------------------------------------------------------------------------------------
    def _pending(self, min_version: int = -1) -> tuple[int, Path] | None:
        if not self._written:
            return None
        newest = max(self._written)
        if newest < min_version or (self._loaded and newest <= self._loaded[-1]):
            return None
        return newest, self._written[newest]

    def _prunable(self) -> list[int]:
        kept = set(self._loaded[-self.keep :])
        return [version for version in self._loaded if version not in kept and not self._in_use[version]]

    def _drop_unloaded_dirs(self) -> None:
        """Directories of versions that were never loaded and never will be (a newer one is loaded)."""
        newest = self._loaded[-1] if self._loaded else None
        if newest is None:
            return
        for version in [v for v in self._written if v < newest and v not in self._loaded]:
            shutil.rmtree(self._written.pop(version), ignore_errors=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.metrics, "lora_in_use": sum(self._in_use.values())}
