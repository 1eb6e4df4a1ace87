"""`asyncrl up` with LoRA on the INT8 default config: adapter-only versions after version 0, `lora/norm_B` grows
from 0, and `checkpoint.merge_lora=true` leaves a `final/` peft directory and a `final-merged/` Hugging Face
directory that load with peft and transformers and give the same log-probs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_up_with_lora_publishes_adapters_only_and_merges_the_final_model(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8_lora.yaml"),
         f"logging.dir={tmp_path}", "logging.name=lora", "train.steps=3", "data.eval_size=0",
         "checkpoint.merge_lora=true", "logging.console=false"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "lora"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert len(steps) == 3
    assert all(r["lora/norm_B"] > 0 for r in steps)  # B starts at 0 and moves on the first step
    assert all(0 < r["sync/bytes_per_version"] < 2e6 for r in steps)  # adapters only: the base is version 0
    summary = json.loads((run / "summary.json").read_text())
    assert Path(summary["final_merged"]) == run / "final-merged"

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path

    base_dir = resolve_model_path("builtin:tiny")  # configs/dapo_int8_lora.yaml's model, built by the run
    merged = AutoModelForCausalLM.from_pretrained(run / "final-merged", dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), run / "final"
    ).eval()
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 4, 6]])
    with torch.no_grad():
        a = torch.log_softmax(merged(ids).logits, -1)
        b = torch.log_softmax(peft_model(ids).logits, -1)
    assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.slow
def test_up_with_lora_on_two_fsdp2_ranks(tmp_path):
    """LoRA under FSDP2: two gloo learner ranks train the adapters, rank 0 publishes them gathered (int8 on the wire)
    and writes `final/` as a peft directory."""
    steps = 2
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"),
         f"logging.dir={tmp_path}", "logging.name=lora2", "model.path=builtin:micro", f"train.steps={steps}",
         "train.groups_per_step=2", "train.group_size=4", "algo.filter_groups=false", "data.eval_size=0",
         "rollout.num_workers=1", "ray.worker_cpus=0.5", "learner.world_size=2", "model.lora.rank=4",
         "model.lora.sync_dtype=int8", "logging.console=false"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "lora2"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "event" not in r]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["loss"] is not None and r["skipped_steps"] == 0 and r["version"] == r["step"] + 1 for r in rows)
    assert all(r["lora/norm_B"] > 0 and 0 < r["sync/bytes_per_version"] < 1e5 for r in rows)
    assert (run / "final" / "adapter_model.safetensors").is_file() and (run / "final" / "adapter_config.json").is_file()
