"""The GPU learner against the CPU one: `python -m learner.device_check --device cuda [--json PATH]`.

A prepared check for a machine with a GPU (`learner.device`, learner/devices.py: written to torch's CUDA APIs, tested
on CPU through the same code). From the same seeded Llama-family model and the same batch of groups, it runs one
learner update (`learner.update.train_on_batch`: log-probs, decoupled PPO loss with TIS, backward, clipping, AdamW,
norm_update) on the CPU and on `--device`, and compares:

- `prox_logp_max_abs`: the proximal log-probs (the step's own forward), largest absolute difference;
- `loss_rel`, `grad_norm_rel`: the loss and the global gradient norm, relative;
- `update_rel`: ||update on the device - update on the CPU|| / ||update on the CPU|| over every weight (AdamW's first
  step is about lr x sign(g), so single weights may differ where g is near 0; the whole update must not);
- then one bf16-autocast update on the device (`precision.train=bf16`), whose loss and weights must be finite.

Prints one JSON object (also written to `--json`) with each figure, its bound (`TOLERANCES`) and `ok`; exits 0 when
every check passes, 1 when one fails, 2 when the device cannot be used. `--device cpu` compares the CPU with itself:
every difference is 0 (the harness's own test).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

TOLERANCES = {"prox_logp_max_abs": 1e-4, "loss_rel": 1e-4, "grad_norm_rel": 1e-3, "update_rel": 5e-2}
"""fp32 on both sides (no TF32: torch's CUDA matmuls default to full fp32); the bounds are summation-order noise."""
VOCAB, GROUPS, GROUP_SIZE = 96, 4, 4


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A seeded 2-layer Llama (hidden 64, GQA 4/2 heads, vocab `VOCAB`) in fp32 on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)  # fmt: skip
    return seeded_(LlamaForCausalLM(config), seed, scale=0.1).train()


@torch.no_grad()
def seeded_(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """`model`'s weights from our own seeded generator, in name order (not transformers' initialisers, so that they
    depend on the seed alone): norms 1 + N(0, 0.1), every other tensor N(0, scale). Returns `model`."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else scale * noise)
    return model


def seeded_groups(seed: int = 0) -> list[list[Any]]:
    """`GROUPS` groups of `GROUP_SIZE` trajectories: one prompt each, responses of 3-9 tokens, rewards 0/1."""
    from common.wire import Trajectory

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(GROUPS):
        prompt = rng.integers(3, VOCAB, 6).astype(np.int32)
        group = []
        for i in range(GROUP_SIZE):
            length = int(rng.integers(3, 10))
            group.append(Trajectory(
                uid=f"g{g}/{i}", group=f"g{g}", prompt_index=g, prompt_ids=prompt,
                response_ids=rng.integers(3, VOCAB, length).astype(np.int32),
                behav_logp=-rng.uniform(2.0, 6.0, length).astype(np.float32),
                versions=np.zeros(length, dtype=np.int32), reward=float(i % 2), correct=bool(i % 2),
                finish="stop", worker="check", t_start=0.0, t_end=1.0,
            ))  # fmt: skip
        groups.append(group)
    return groups


def one_update(model: torch.nn.Module, device: torch.device, precision: str = "fp32") -> dict[str, Any]:
    """One `train_on_batch` of `model` moved to `device`: its loss, gradient norm, proximal log-probs and weights
    before and after (on the CPU)."""
    from common.config import load_config
    from learner.acrl import AcrlReference
    from learner.batch import collate
    from learner.optimizer import adamw
    from learner.precision import LossScaler
    from learner.sections import UpdateSections
    from learner.update import train_on_batch

    sections = UpdateSections.pick(load_config(None, [
        "rollout.max_new_tokens=16", "rollout.temperature=1.0", "algo.overlong.len=0", "optim.lr=1e-3",
        "loss.weighting=tis", f"precision.train={precision}", "learner.fp32_gemm=blas", "learner.fused_ops=false",
    ]))  # fmt: skip
    model = model.to(device)
    before = {name: param.detach().cpu().clone() for name, param in model.named_parameters()}
    optimizer = adamw(model.parameters(), sections.optim)
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), collate(seeded_groups(), 0), sections,
                            AcrlReference(sections.loss.acrl))  # fmt: skip
    after = {name: param.detach().cpu().clone() for name, param in model.named_parameters()}
    return {"loss": result.metrics["loss"], "grad_norm": result.metrics["grad_norm"], "prox": result.prox_logp,
            "before": before, "after": after, "skipped": result.skipped}  # fmt: skip


def compare(device: torch.device) -> dict[str, Any]:
    """The figures of the module docstring for `device` against the CPU."""
    base = tiny_llama()
    cpu, other = one_update(copy.deepcopy(base), torch.device("cpu")), one_update(copy.deepcopy(base), device)
    step_cpu = torch.cat([(cpu["after"][n] - cpu["before"][n]).reshape(-1) for n in cpu["after"]])
    step_other = torch.cat([(other["after"][n] - other["before"][n]).reshape(-1) for n in other["after"]])
    figures = {
        "prox_logp_max_abs": float((other["prox"] - cpu["prox"]).abs().max()),
        "loss_rel": abs(other["loss"] - cpu["loss"]) / max(abs(cpu["loss"]), 1e-12),
        "grad_norm_rel": abs(other["grad_norm"] - cpu["grad_norm"]) / max(cpu["grad_norm"], 1e-12),
        "update_rel": float((step_other - step_cpu).norm() / step_cpu.norm().clamp_min(1e-30)),
    }
    checks = {name: {"value": value, "bound": TOLERANCES[name], "ok": value <= TOLERANCES[name]}
              for name, value in figures.items()}  # fmt: skip
    bf16 = one_update(copy.deepcopy(base), device, precision="bf16")
    finite = math.isfinite(bf16["loss"]) and all(bool(t.isfinite().all()) for t in bf16["after"].values())
    checks["bf16_update_finite"] = {"value": float(finite), "bound": 1.0, "ok": finite and not bf16["skipped"]}
    return {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
            "checks": checks, "ok": all(check["ok"] for check in checks.values())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner.device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="`learner.device` to check against the CPU (cuda, cuda:N)")
    parser.add_argument("--json", dest="json_path", default="", help="also write the result here")
    args = parser.parse_args(argv)
    from common.config_rules import is_device_name
    from learner.devices import rank_device

    if not is_device_name(args.device):
        print(f"device_check: --device must be cpu, cuda or cuda:N, got {args.device!r}", file=sys.stderr)
        return 2
    try:
        device = rank_device(args.device, 0)
    except RuntimeError as error:
        print(f"device_check: {error}", file=sys.stderr)
        return 2
    out = compare(device)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
