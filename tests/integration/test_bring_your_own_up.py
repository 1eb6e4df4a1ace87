"""Issue 19's combined acceptance: `asyncrl up` on the built-in model whose tokenizer is given a chat template,
with a messages-format parquet file, a nested answer key (`reward_model.ground_truth`), `data.chat_template=auto`,
a user reward file and `loss.kl.coef=0.01`: two steps complete and the KL reaches metrics.jsonl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the built-in vocabulary: digits, + - =
USER_REWARD = """
def exact(response, answer, row):
    assert row["reward_model"]["ground_truth"] == answer  # the dataset row reaches the function, held-out ones too
    assert isinstance(row["prompt"], list) and isinstance(row["index"], int)
    return {"score": float(response.strip() == answer), "chars": len(response)}
"""


@pytest.mark.slow
def test_up_with_a_chat_parquet_nested_answer_user_reward_and_kl(tmp_path):
    from transformers import AutoTokenizer

    from common.builtin_model import resolve_model_path

    model_dir = tmp_path / "micro-chat"
    shutil.copytree(resolve_model_path("builtin:micro"), model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model_dir)
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "reward_model": {"ground_truth": str(a + b)}}
        for a in range(1, 9)
        for b in range(1, 9)
    ]
    data = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    reward = tmp_path / "my_reward.py"
    reward.write_text(USER_REWARD)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"),
         f"logging.dir={tmp_path}", "logging.name=byo", "train.steps=2", "train.groups_per_step=4",
         f"model.path={model_dir}", "data.task=dataset", f"data.path={data}", "data.prompt_key=prompt",
         "data.answer_key=reward_model.ground_truth", "data.chat_template=auto", "data.eval_size=4",
         f"reward.fn={reward}:exact", "loss.kl.coef=0.01", "algo.filter_groups=false", "logging.console=false"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (tmp_path / "byo" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "step" in r and "event" not in r]
    assert len(steps) == 2
    for row in steps:  # reward/* of a step: the samples scored since the previous one (none, some steps)
        assert row["loss/kl"] >= 0.0 and row.get("reward/errors", 0) == 0  # the user function's row check held
    assert any(row.get("reward/chars", 0) > 0 for row in steps)  # its extra metric reached metrics.jsonl
    assert steps[1]["loss/kl"] > 0.0  # the policy moved away from the frozen reference after one update
    evals = [r for r in map(json.loads, lines) if r.get("event") == "eval"]
    assert evals and evals[-1]["eval/reward_errors"] == 0  # held-out rows carry the dataset's fields as training's
