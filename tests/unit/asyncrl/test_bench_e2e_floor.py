"""The fp32 floor of `asyncrl bench e2e`'s decode workload: what it counts, and the ceilings derived from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asyncrl.bench.e2e_floor import ceilings, decode_floor, linear_parameters, step_tokens
from asyncrl.bench.e2e_workloads import QUICK_DECODE_SHAPE, build_decode_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_decode_model(tmp_path_factory.mktemp("floor") / "model", QUICK_DECODE_SHAPE, 16)


def test_linear_parameters_leave_out_the_embedding_and_count_the_head(model_dir: str) -> None:
    shape = QUICK_DECODE_SHAPE
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = shape.hidden_size // shape.num_heads
    per_layer = (
        2 * shape.hidden_size * shape.hidden_size  # q, o
        + 2 * shape.hidden_size * shape.num_kv_heads * head_dim  # k, v
        + 3 * shape.hidden_size * shape.intermediate_size  # gate, up, down
    )
    params, hidden, intermediate = linear_parameters(model_dir)
    assert (hidden, intermediate) == (shape.hidden_size, shape.intermediate_size)
    assert params == shape.num_layers * per_layer + config["vocab_size"] * shape.hidden_size


def test_step_tokens_read_each_prompt_and_all_but_the_last_new_token(model_dir: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    prompts = ["1+2=", "12+345="]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": 0}) + "\n" for p in prompts))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mean_prompt = sum(len(tokenizer(p)["input_ids"]) for p in prompts) / len(prompts)
    assert step_tokens(path, model_dir, samples_per_step=4, max_new_tokens=16) == pytest.approx(4 * (mean_prompt + 15))
    path.write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        step_tokens(path, model_dir, 4, 16)


def test_the_floor_is_the_linear_flops_at_the_measured_rate(model_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "3+4=", "answer": 7}) + "\n")
    floor = decode_floor(model_dir, path, samples_per_step=8, max_new_tokens=16)
    params, _, _ = linear_parameters(model_dir)
    assert floor["decode_train_linear_flops"] == pytest.approx(6 * params * floor["decode_train_tokens_per_step"])
    assert floor["decode_train_floor_s"] == pytest.approx(
        floor["decode_train_linear_flops"] / (floor["decode_fp32_gemm_gflops"] * 1e9)
    )


def test_ceilings_pack_generation_with_training_at_the_floor() -> None:
    metrics = {"decode_train_floor_s": 10.0, "decode_trl_steady_train_s": 11.0, "decode_sync_steady_train_s": 12.0,
               "decode_trl_steady_step_s": 30.0, "decode_sync_steady_step_s": 15.0}  # fmt: skip
    out = ceilings(metrics, bound_step_s=14.0, gen_core_s_per_step=4.0, cores=2)
    assert out["decode_trl_train_vs_floor"] == pytest.approx(1.1)
    assert out["decode_sync_train_vs_floor"] == pytest.approx(1.2)
    assert math.isnan(out["decode_async_train_vs_floor"])  # no async run: no figure, not a made-up one
    assert out["decode_ceiling_vs_trl_samples_s"] == pytest.approx(30.0 / ((4.0 + 20.0) / 2))
    assert out["decode_ceiling_async_vs_sync"] == pytest.approx(15.0 / 14.0)
