"""The frozen reference policy of the KL penalty (`loss.kl.coef > 0`): the run's initial model, never trained.

    initial model --fp32, UAQ as the policy (quant.uaq.scale)--> frozen (no grad, eval) --> FSDP2 shards like the
      policy (world_size > 1)
    each train step: lref (B, T) = the proximal pass (`learner.update.proximal_logp`) on the reference: the same
      micro-batches, the same autocast (`precision.train`), no grad, the LM head only at the response tokens in
      chunks (`learner.logprobs`), each rank its rows, then a sum over ranks. Other weights cannot share the
      policy's own forward, so the reference runs its own no-grad pass, also when lp comes from the training forward

A fresh run copies the policy right after UAQ (before it is made rollout-aligned, given LoRA adapters or sharded):
the very tensors it starts from, so lref == lc and the KL is exactly 0 before the first update. A resumed run
rebuilds the reference from the run's initial model directory (`model_dir`, not the checkpoint, whose weights have
been trained) with the same UAQ scale: the same tensors, bit for bit. A LoRA run (initial policy: the base,
B = 0) copies its base, which it reloads from `model_dir` on resume too. Nothing is saved in checkpoints.

With `learner.rollout_aligned` the policy's linears run on the rollout's quantized operands, but the reference runs
in the training precision (plain linears under `precision.train` autocast): the penalty pulls toward the initial
full-precision model, and it is not 0 at step 0 (it is the quantization gap then).

With `loss.kl.coef = 0` (the default) nothing is built: no second model in memory, no extra forward.
"""

from __future__ import annotations

import copy

import torch

from common.config import KlConfig
from learner import distributed
from learner.distributed import Dist
from quant_sync.uaq import apply_uaq


def initial_reference(
    kl: KlConfig,
    model_dir: str,
    uaq_scale: float,
    ranks: Dist,
    policy: torch.nn.Module | None = None,
    trust_remote_code: bool = False,
    device: torch.device | None = None,
) -> torch.nn.Module | None:
    """The frozen reference model for `kl`, or None when `kl.coef` is 0 (nothing is loaded).

    `policy`: the fresh run's policy just after UAQ, still a plain unsharded fp32 module: copied. None (a resumed
    run): the initial weights are loaded from `model_dir` and reparametrized with `uaq_scale` as a fresh run's were.
    Every rank calls it (FSDP2 sharding is collective-free but every rank must shard alike)."""
    if kl.coef <= 0:
        return None
    if policy is not None:
        reference = copy.deepcopy(policy)
    else:
        from learner.pretrained import load_causal_lm

        reference = load_causal_lm(model_dir, trust_remote_code)
        apply_uaq(reference, uaq_scale)
    if device is not None:  # the policy's device (`learner.device`): a copy of it is there already
        reference.to(device)
    reference.requires_grad_(False)
    reference.eval()
    if ranks.world > 1:
        distributed.shard_model(reference)
    return reference
