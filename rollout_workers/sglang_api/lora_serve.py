"""`asyncrl serve --enable-lora`: SGLang 0.5.x's dynamic LoRA API over the embedded engine.

    POST /load_lora_adapter {"lora_name", "lora_path", "pinned"} ── a peft directory read into published-name tensors
    POST /unload_lora_adapter {"lora_name"} ── unregistered at once; returns once no request uses it
    POST /generate {"lora_path": name | [name or null per prompt]} ── each request holds its adapter (or none)
    scheduler thread: admit requests in order; one whose adapter is not the engine's waits until the running ones
        finish, then the engine switches: base + adapter built as one version (`ModelWeights`, the base's prepared
        forms reused, so a switch builds only the adapters), the weight-version label unchanged

What SGLang does (`managers/tokenizer_communicator_mixin.py`, `lora/lora_registry.py`, `lora/lora_manager.py`,
`entrypoints/http_server.py`), and what is answered the same way here:

| case | answer (400 unless said) |
|---|---|
| load / unload without `--enable-lora` | `{"success": false, "error_message": "LoRA is not enabled. ..."}` |
| load: a name already loaded | `Failed to load LoRA adapter NAME because it is already loaded` |
| load: rank over `--max-lora-rank`, target not in `--lora-target-modules` | `... is incompatible with ...` |
| load: no peft directory at `lora_path` | names the path (SGLang tries the hub; we read local directories) |
| load / unload succeeded | 200 `{"success": true, "error_message": "", "loaded_adapters": {name: path}}` |
| unload: an unknown name | `LoRA with name NAME does not exist. Loaded LoRAs: ...` |
| /generate naming an adapter, no `--enable-lora` | `{"error": {"message": "LoRA adapter 'NAME' was requested, ..."}}` |
| /generate naming an adapter never loaded | `Got LoRA adapter that has never been loaded: NAME ...` |
| /generate naming an adapter unloaded before | loaded again from its path first (SGLang 0.5.9's implicit reload) |
| `/v1/*completions` | `model: "base:adapter"` (first colon) wins over `lora_path` (`openai/serving_base.py`) |
| `/v1/models` | one more card per loaded adapter: `id` its name, `root` its path, `parent` the served model |

The one difference: SGLang runs up to `--max-loras-per-batch` adapters in one batch (S-LoRA style kernels); the
embedded engine runs one set of adapters (`LowRank` per linear) for the whole batch, so requests of different
adapters run in separate steps, in arrival order. Every token is still computed with its request's adapter: an
adapter's log-probs are the engine's on base + adapter, which equal the learner's (tests/unit/rollout_workers/
test_serve_lora.py).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from quant_sync.export import LORA_A, LORA_B, LORA_SCALING
from rollout_workers.sglang_api.protocol import BadRequest

if TYPE_CHECKING:
    import torch

    from quant_sync.update import WeightUpdate
    from rollout_workers.sglang_api.service import ModelService

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                     "gate_up_proj", "embed_tokens", "lm_head")  # fmt: skip
"""`--lora-target-modules` choices (SGLang's `SUPPORTED_LORA_TARGET_MODULES`, plus `all`; server.py)."""
ENGINE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""What the embedded engine can put an adapter on: the decoder blocks' linears."""
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
ADAPTER_FILE = "adapter_model.safetensors"
UNLOAD_POLL_S = 0.05


class LoadLoRAAdapterReqInput(BaseModel):
    """SGLang's `LoadLoRAAdapterReqInput` (`managers/io_struct.py`)."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(BaseModel):
    """SGLang's `UnloadLoRAAdapterReqInput`."""

    lora_name: str
    lora_id: str | None = None


def attach(service: ModelService, args: argparse.Namespace) -> None:
    """Give `service` its LoRA adapters from the command line (`service.lora`); raises ValueError as SGLang's start-up
    checks do. Without `--enable-lora` (and no `--lora-paths`) nothing changes."""
    if not (args.enable_lora or args.lora_paths):
        return
    targets = set(args.lora_target_modules or [])
    unknown = sorted(targets - {*SUPPORTED_TARGETS, "all"})
    if unknown:
        raise ValueError(f"--lora-target-modules: {unknown} not among {', '.join(SUPPORTED_TARGETS)}, all")
    if "all" in targets:
        if len(targets) > 1:
            raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
        targets = set(SUPPORTED_TARGETS)
    if not args.lora_paths and not (args.max_lora_rank and targets):
        raise ValueError("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                         "--lora-target-modules for LoRA initialization.")  # fmt: skip
    adapters = LoraAdapters(service, args.max_lora_rank, targets or None)
    for entry in args.lora_paths or []:
        name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
        status, body = adapters.load(name, path)
        if status != 200:
            raise ValueError(f"--lora-paths {entry}: {body['error_message']}")
    service.lora = adapters


def result(success: bool, error_message: str | None, loaded: dict[str, str] | None) -> dict[str, Any]:
    """SGLang's `LoRAUpdateOutput` as its server serializes it."""
    return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error_message,
            "loaded_adapters": loaded}  # fmt: skip


def load_route(service: ModelService, obj: LoadLoRAAdapterReqInput) -> tuple[int, dict[str, Any]]:
    if service.lora is None:
        return 400, result(False, NOT_ENABLED, None)
    return service.lora.load(obj.lora_name, obj.lora_path, obj.pinned)


def unload_route(service: ModelService, obj: UnloadLoRAAdapterReqInput) -> tuple[int, dict[str, Any]]:
    if service.lora is None:
        return 400, result(False, NOT_ENABLED, None)
    return service.lora.unload(obj.lora_name)


def resolve_adapters(lora: LoraAdapters | None, lora_path: Any, batch: int) -> list[Adapter | None]:
    """The adapter of each prompt of a `/generate` (`lora_path`: a name for all, or one name or null per prompt);
    raises BadRequest in SGLang's words for an adapter it would refuse."""
    if not lora_path:
        return [None] * batch
    names = lora_path if isinstance(lora_path, list) else [lora_path] * batch
    if len(names) != batch:
        raise BadRequest(f"lora_path has {len(names)} entries for a batch of {batch} prompts")
    if lora is None:
        first = next((name for name in names if name), None)
        raise BadRequest(f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server "
                         "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                         "endpoint.")  # fmt: skip
    return [lora.resolve(name) if name else None for name in names]


def openai_lora_path(model: str | None, lora_path: Any) -> Any:
    """The `lora_path` of a `/v1` request: the adapter of `model: "base:adapter"` (split at the first colon), else
    the request's own `lora_path` (SGLang's `OpenAIServingBase._resolve_lora_path`)."""
    if model and ":" in model:
        adapter = model.split(":", 1)[1].strip()
        if adapter:
            return adapter
    return lora_path


def adapter_cards(service: ModelService) -> list[Any]:
    """`/v1/models` cards of the loaded adapters (id the name, root the path, parent the served model), as SGLang
    lists them with `--enable-lora`."""
    if service.lora is None:
        return []
    from rollout_workers.sglang_api.openai_schemas import ModelCard

    return [
        ModelCard(id=name, root=path, parent=service.served_model_name) for name, path in service.lora.loaded().items()
    ]


@dataclass(eq=False)
class Adapter:
    """A loaded adapter: its tensors under the engine's published names (`<linear>.lora_A` (r, in), `.lora_B`
    (out, r), `.lora_scaling` (1,), float32). A request holds the object, so an unload cannot pull it from under it."""

    name: str
    path: str
    pinned: bool
    rank: int
    tensors: dict[str, torch.Tensor]


class LoraAdapters:
    """The adapters `asyncrl serve --enable-lora` holds, and the scheduler's one-adapter-at-a-time switch.

    `load`, `unload`, `resolve` run on the HTTP side (thread pool); `admit` and `on_base` on the scheduler thread."""

    def __init__(self, service: ModelService, max_rank: int | None, targets: set[str] | None):
        self.service = service
        self.max_rank = max_rank
        self.targets = targets
        self._lock = threading.Lock()
        self._registry: dict[str, Adapter] = {}  # name -> adapter, in load order
        self._seen: dict[str, tuple[str, bool]] = {}  # every name ever loaded -> (path, pinned): implicit reloads
        self._base: WeightUpdate = service._load(service.model_dir)  # the base the adapters sit on (same values)
        self.active: Adapter | None = None
        """The adapter the engine runs now (None: the base alone)."""
        self.switches = 0

    # ---- the HTTP side -------------------------------------------------------------------------------------------
    def loaded(self) -> dict[str, str]:
        with self._lock:
            return {name: adapter.path for name, adapter in self._registry.items()}

    def load(self, name: str, path: str, pinned: bool = False) -> tuple[int, dict[str, Any]]:
        """`/load_lora_adapter`: (status, body)."""
        try:
            config, tensors = read_adapter_dir(path)
            if config.get("added_tokens"):
                raise ValueError("LoRA serving currently doesn't support adapters that add tokens to the vocabulary")
            with self._lock:
                if name in self._registry:
                    raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
            rank = int(config["r"])
            modules = {module.rsplit(".", 1)[-1] for module in config.get("target_modules") or []}
            allowed = {part for target in (self.targets or ()) for part in _FUSED.get(target, (target,))}
            if (self.max_rank is not None and rank > self.max_rank) or (self.targets and not modules <= allowed):
                raise ValueError(
                    f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
                )
            self._check_fits(tensors)
        except Exception as err:  # a bad adapter must not take the server down: SGLang answers 400
            return 400, result(False, str(err), self.loaded())
        with self._lock:
            self._registry[name] = Adapter(name, str(path), pinned, rank, tensors)
            self._seen[name] = (str(path), pinned)
        return 200, result(True, "", self.loaded())

    def unload(self, name: str) -> tuple[int, dict[str, Any]]:
        """`/unload_lora_adapter`: unregister (new requests naming it are refused), then wait until no request holds
        it, as SGLang's `wait_for_unload` does."""
        with self._lock:
            adapter = self._registry.pop(name, None)
            names = list(self._registry)
        if adapter is None:
            return 400, result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({names})", None)
        while self.service._call(lambda: self._in_use(adapter)):
            time.sleep(UNLOAD_POLL_S)
        return 200, result(True, "", self.loaded())

    def resolve(self, name: str) -> Adapter:
        """The loaded adapter `name` for a request; one unloaded before is loaded again from its path first."""
        with self._lock:
            adapter = self._registry.get(name)
            seen = self._seen.get(name)
            names = list(self._seen)
        if adapter is not None:
            return adapter
        if seen is None:
            raise BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: dict_keys({names}).")  # fmt: skip
        status, body = self.load(name, *seen)
        if status != 200 and "already loaded" not in body["error_message"]:
            raise BadRequest(f"Failed to implicitly load LoRA adapter {name}: {body['error_message']}")
        with self._lock:
            return self._registry[name]

    # ---- the scheduler thread ------------------------------------------------------------------------------------
    def admit(self, req: Any) -> bool:
        """Whether the waiting request `req` may join the engine now: its adapter is the engine's, or the engine is
        idle and switches to it. A switch that fails ends the request's group (aborted, the reason in the log)."""
        want = getattr(req, "adapter", None)
        if want is self.active:
            return True
        if self.service.engine.busy:
            return False
        try:
            self._switch(want)
        except Exception as err:
            traceback.print_exc()
            from rollout_workers.sglang_api import protocol

            group = self.service._waiting.pop(0)
            for member in group:
                member.finish = protocol.finish_abort(f"LoRA adapter {want.name if want else None}: {err}", 500)
                member.settle()
            return False
        return True

    def on_base(self, update: WeightUpdate) -> WeightUpdate:
        """A new base (`/update_weights_from_disk`): kept for the adapters, and returned with the engine's adapter on
        top, so the requests running keep their adapter."""
        from quant_sync.update import WeightUpdate

        self._base = update
        if self.active is None:
            return update
        return WeightUpdate(update.version, {**update.tensors, **self.active.tensors}, update.scheme)

    def _switch(self, adapter: Adapter | None) -> None:
        from quant_sync.update import WeightUpdate

        engine, labels = self.service.engine, self.service._labels
        current = engine.version
        tensors = self._base.tensors if adapter is None else {**self._base.tensors, **adapter.tensors}
        engine.stage_weights(WeightUpdate(current + 1, tensors, self._base.scheme))
        engine.swap_now()
        labels[engine.version] = labels.get(current, str(current))  # the same weights version: only the adapter moved
        self.active = adapter
        self.switches += 1

    def _in_use(self, adapter: Adapter) -> bool:
        waiting = (req for group in self.service._waiting for req in group)
        running = self.service._by_seq.values()
        return any(getattr(req, "adapter", None) is adapter for source in (waiting, running) for req in source)

    def _check_fits(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise ValueError unless the adapters sit on decoder linears of the served model with fitting shapes."""
        from rollout_workers.embedded.engine import build_weight_map
        from rollout_workers.embedded.model import check_weight_shapes

        for name in tensors:
            module = name.rsplit(".", 1)[0]
            if module.rsplit(".", 1)[-1] not in ENGINE_TARGETS:
                raise ValueError(f"{name}: asyncrl serve puts adapters on {', '.join(ENGINE_TARGETS)} only")
        from quant_sync.update import WeightUpdate

        combined = WeightUpdate(-1, {**self._base.tensors, **tensors}, self._base.scheme)
        check_weight_shapes(self.service.engine.arch, build_weight_map(combined))


def read_adapter_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A peft LoRA directory -> (adapter_config.json, tensors under the engine's names with `alpha / r` as
    `.lora_scaling`). Raises ValueError naming the path or tensor that is wrong."""
    import torch
    from safetensors.torch import load_file

    directory = Path(path)
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"{path}: not a LoRA adapter directory (no adapter_config.json); asyncrl serve loads local "
                         "peft directories only")  # fmt: skip
    try:
        config = json.loads(config_path.read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{config_path}: not a peft LoRA config ({type(err).__name__}: {err})") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{config_path}: only plain LoRA adapters are served (peft_type LORA, no rslora, no DoRA)")
    if rank < 1:
        raise ValueError(f"{config_path}: r must be at least 1, got {rank}")
    patterned = [key for key in ("rank_pattern", "alpha_pattern") if config.get(key)]
    if patterned:  # per-module ranks or alphas: one alpha / r for every module would serve another model
        raise ValueError(f"{config_path}: {' and '.join(patterned)} (per-module ranks or scales) are not served by "
                         "asyncrl serve: save the adapter with one r and lora_alpha")  # fmt: skip
    weights_path = directory / ADAPTER_FILE
    if not weights_path.is_file():
        raise ValueError(f"{path}: no {ADAPTER_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    scaling = torch.tensor([alpha / rank], dtype=torch.float32)
    for key, value in load_file(str(weights_path)).items():
        stem = key.removeprefix("base_model.model.")
        for part, suffix in ((".lora_A.weight", LORA_A), (".lora_B.weight", LORA_B)):
            if stem.endswith(part):
                module = stem[: -len(part)]
                found = value.shape[0] if suffix == LORA_A else value.shape[-1]
                if value.dim() != 2 or found != rank:  # the rank --max-lora-rank checks is r: the tensors must agree
                    raise ValueError(f"{weights_path}: {key} has shape {tuple(value.shape)}, not rank r={rank}")
                tensors[module + suffix] = value.to(torch.float32).contiguous()
                tensors[module + LORA_SCALING] = scaling
                break
        else:
            raise ValueError(f"{weights_path}: {key} is not a LoRA A or B matrix")
    if not tensors:
        raise ValueError(f"{weights_path}: no LoRA tensors")
    return config, tensors
