"""Where a learner rank computes (`learner.device`) and how its ranks talk.

On `cpu` everything is as it always was: gloo, the CPU kernels (`learner.fp32_gemm`, `learner.fused_ops`) and the
train gate (`common.train_gate`: workers on the learner's machine pause while it trains on every core).

On CUDA a rank's model, optimizer state and forward/backward live on its GPU, while the step's bookkeeping (the
batch, advantages, the loss and its metrics, norm_update's sums) stays on the CPU: `learner.logprobs` moves each
micro-batch's token ids to the GPU and the log-probs back (both differentiable copies), so the loss code is the
CPU learner's, and only the weights' side changes device. The process group is then `cpu:gloo,cuda:nccl`: FSDP2's
collectives on CUDA tensors go over NCCL, the learner's own on CPU tensors (the batch's broadcast, the loss
metrics) over gloo. The train gate stays open: the workers' cores are not where the learner computes.

Written to torch's documented CUDA and torch.distributed APIs and tested here on CPU through the same code; it has
not run on a GPU (none was lent to this project's sessions).
"""

from __future__ import annotations

import torch

CUDA_BACKEND = "cpu:gloo,cuda:nccl"
"""The process group of CUDA ranks: NCCL for CUDA tensors, gloo for CPU ones (one group, chosen by tensor device)."""


def rank_device(device: str, rank: int) -> torch.device:
    """The torch device of learner rank `rank` for `learner.device` (validated: cpu, cuda or cuda:N).

    `cuda`: GPU `rank` modulo the GPUs this process sees (under Ray, the one GPU `ray.learner_gpus` assigned it);
    `cuda:N`: GPU N + `rank` (ranks on consecutive GPUs from N: a node's rollout on GPUs 0..N-1, its learner after).
    Raises with what is missing when this process sees no GPU, or not that one."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (" (a CPU build)" if torch.version.cuda is None else "")
        raise RuntimeError(
            f"`learner.device={device}` but this learner process sees no GPU (torch.cuda.is_available() is False; "
            f"{build}): install a CUDA build of torch on the learner's machine and give its actors GPUs "
            "(`ray.learner_gpus`), or set `learner.device=cpu`"
        )
    count = torch.cuda.device_count()
    index = int(device.split(":", 1)[1]) + rank if ":" in device else rank % count
    if index >= count:
        raise RuntimeError(
            f"`learner.device={device}` puts rank {rank} on GPU {index}, but this learner process sees {count} "
            f"GPU(s) (0..{count - 1}; under Ray, only the ones it was given: use `learner.device=cuda` there)"
        )
    return torch.device("cuda", index)


def process_group_backend(device: torch.device) -> str:
    """The torch.distributed backend of ranks on `device`: gloo on CPU, `CUDA_BACKEND` on CUDA."""
    return CUDA_BACKEND if device.type == "cuda" else "gloo"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter (a DTensor's is its local shard's); CPU for a model without any."""
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every tensor on the CPU (quant_sync quantizes and publishes CPU tensors); unchanged on CPU."""
    return {name: value.detach().cpu() if value.device.type != "cpu" else value for name, value in state.items()}
