"""Learner ranks: torch.distributed (gloo on CPU, NCCL for CUDA tensors: `learner.devices`) and FSDP2
(`torch.distributed.fsdp.fully_shard`).

Data parallel over responses, parameters sharded: every decoder layer is its own FSDP2 unit, the root holds the
embeddings, final norm and LM head. Rank 0 talks to the buffer and to quant_sync; it collates each batch and
broadcasts its tensors (no pickle) to the other ranks, which take their share of the rows. Gradients are reduced
by FSDP2 as an average over ranks, so each rank scales its loss by the world size to obtain the sum: the same
gradient as one process over all rows (gloo has no pre-multiplied sum, so `set_gradient_divide_factor` is out).

With world size 1 every helper here is a no-op and the model stays a plain module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist

from learner.batch import Batch
from learner.devices import model_device, process_group_backend

# Wire codes of the batch fields' dtypes for the broadcast header (bool travels as uint8: gloo has no bool; float64:
# the rewards, as the wire carries them: `learner.losses.advantages`).
_DTYPES = {0: torch.int64, 1: torch.float32, 2: torch.uint8, 3: torch.float64}
_CODES = {torch.int64: 0, torch.float32: 1, torch.bool: 2, torch.float64: 3}


@dataclass(frozen=True, slots=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = Dist()
"""One process, no torch.distributed."""


FILE_RENDEZVOUS = "file://"
"""A rendezvous of ranks on one machine: a torch.distributed FileStore, which opens no port (a TCPStore listens
on every interface, whatever host it is given)."""


def start_rendezvous(host: str = "127.0.0.1") -> tuple[dist.TCPStore, str]:
    """A torch.distributed key-value store on a port the OS picks (no race), hosted by the caller.

    Returns the store (keep it alive until every rank has joined) and its `host:port` for `init_distributed`.
    For ranks spread over a Ray cluster; ranks on one machine use `local_rendezvous`.
    """
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    return store, f"{host}:{store.port}"


def local_rendezvous(directory: str) -> str:
    """The rendezvous of ranks that share this machine's filesystem: a FileStore in `directory` (a fresh, private
    one per learner group: the file must not hold an earlier group's keys)."""
    return f"{FILE_RENDEZVOUS}{directory}/store"


def init_distributed(
    rank: int, world: int, rendezvous: str, timeout_s: float = 300.0, device: torch.device | None = None
) -> Dist:
    """Join the learner's process group at `rendezvous`: `host:port` of `start_rendezvous`, or `local_rendezvous`'s
    file (gloo's own sockets then listen on loopback only). Ranks on `device` CPU (the default) use gloo, on CUDA
    `learner.devices.CUDA_BACKEND` (NCCL for CUDA tensors, gloo for CPU ones), after selecting their GPU."""
    device = torch.device("cpu") if device is None else device
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL's communicators are made: each rank on its own GPU
    if world == 1:
        return Dist()
    if not rendezvous:
        raise ValueError("learner.world_size > 1 needs a rendezvous (start_rendezvous or local_rendezvous)")
    timeout = timedelta(seconds=timeout_s)
    if rendezvous.startswith(FILE_RENDEZVOUS):
        store: dist.Store = dist.FileStore(rendezvous.removeprefix(FILE_RENDEZVOUS), world)
        store.set_timeout(timeout)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair sockets on loopback, not the host's address
    else:
        host, port = rendezvous.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    backend = process_group_backend(device)  # by where the ranks compute: a CPU learner on a GPU machine keeps gloo
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return Dist(rank=rank, world=world)


def shard_model(model: torch.nn.Module) -> None:
    """FSDP2: one unit per decoder layer, then the root (embeddings, final norm, LM head), on a mesh of the
    model's device type (every rank's model already on its device: `learner.devices.rank_device`).

    The root reshards after forward too (FSDP2 keeps it gathered by default), so that between forwards every
    parameter is this rank's shard: the step's snapshot, restore and norm_update work on shards.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(model_device(model).type, (dist.get_world_size(),))
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) parameter or gradient."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def to_float(value: torch.Tensor | float) -> float:
    """A Python float from a scalar tensor, DTensor (e.g. a global grad norm) or float."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def all_reduce_(tensor: torch.Tensor, ranks: Dist, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (`sum` or `max`) over the learner ranks; identity with one rank."""
    if ranks.world > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def broadcast_batch(batch: Batch | None, ranks: Dist) -> Batch:
    """Rank 0's batch on every rank: a header of dtypes and shapes, then one broadcast per field."""
    if ranks.world == 1:
        assert batch is not None
        return batch
    names = [f.name for f in fields(Batch)]
    header = torch.zeros((len(names), 4), dtype=torch.int64)  # dtype code, ndim, dim 0, dim 1
    if ranks.is_main:
        assert batch is not None
        for i, name in enumerate(names):
            value = getattr(batch, name)
            header[i, 0], header[i, 1] = _CODES[value.dtype], value.dim()
            header[i, 2 : 2 + value.dim()] = torch.tensor(value.shape)
    dist.broadcast(header, src=0)
    values = {}
    for i, name in enumerate(names):
        code, ndim = int(header[i, 0]), int(header[i, 1])
        shape = header[i, 2 : 2 + ndim].tolist()
        if ranks.is_main:
            assert batch is not None
            original = getattr(batch, name)
            buf = original.to(torch.uint8) if original.dtype == torch.bool else original.contiguous()
        else:
            buf = torch.empty(shape, dtype=_DTYPES[code])
        dist.broadcast(buf, src=0)
        values[name] = buf.bool() if code == _CODES[torch.bool] else buf
    return Batch(**values)


def full_state_dict(model: torch.nn.Module, ranks: Dist) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict: on rank 0 with FSDP2 (a collective: every rank must call it), else live."""
    if ranks.world == 1:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if ranks.is_main else {}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Dist) -> dict:
    """The optimizer state as one unsharded dict keyed by parameter name, whatever the world size (so that any
    world size can load it): on rank 0; a collective with FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=ranks.world > 1)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    return state if ranks.is_main else {}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, ranks: Dist) -> None:
    """Load a `full_optimizer_state` dict into this rank's (sharded) optimizer; every rank passes the full dict.

    Checkpoints of single-process learners written before the state was keyed by name (keyed by parameter index,
    `optimizer.state_dict()`) are converted by the order of `model.named_parameters()`, the optimizer's order."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if any(isinstance(key, int) for key in state.get("state", {})) or any(
        isinstance(index, int) for group in state.get("param_groups", []) for index in group["params"]
    ):
        names = [name for name, _ in model.named_parameters()]
        groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
        state = {"state": {names[index]: value for index, value in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def close(ranks: Dist) -> None:
    if ranks.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
