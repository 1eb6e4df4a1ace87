"""`asyncrl bench sync`'s LoRA rows: an adapter-only version against the full INT8 one, through a real publisher."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from asyncrl.bench import sync_bench
from asyncrl.bench.engine_bench import LORA_RANK, lora_adapter_tensors
from common.builtin_model import resolve_model_path
from quant_sync.export import export_rollout_tensors, pack_adapters


def test_the_lora_sync_rows_count_the_adapter_version_against_the_full_int8_one():
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = sync_bench._lora_sync(model)
    state = model.state_dict()
    full = export_rollout_tensors(state, "int8", quantize_head=True)
    adapters = lora_adapter_tensors(state, sync_dtype=sync_bench.LORA_SYNC_DTYPE)
    packed = pack_adapters(adapters)  # as learner/lora.py publishes an adapter-only version
    assert rows["big_full_version_bytes"] == sum(t.nbytes for t in full.values())
    assert rows[f"big_lora{LORA_RANK}_version_bytes"] == sum(t.nbytes for t in packed.values())
    assert 0 < sum(t.nbytes for t in packed.values()) - sum(t.nbytes for t in adapters.values()) < 8192  # index
    fp32, bf16, int8 = (rows[f"big_lora{LORA_RANK}_{dtype}_version_bytes"] for dtype in ("fp32", "bf16", "int8"))
    for dtype, published in zip(("fp32", "bf16", "int8"), (fp32, bf16, int8), strict=True):
        expected = pack_adapters(lora_adapter_tensors(state, sync_dtype=dtype))
        assert published == sum(t.nbytes for t in expected.values()), dtype
    assert int8 < bf16 < fp32
    payload = {d: sum(t.nbytes for t in lora_adapter_tensors(state, sync_dtype=d).values()) for d in ("fp32", "int8")}
    assert payload["int8"] < 0.3 * payload["fp32"]  # 1 byte a value plus one float32 scale per rank component
    assert rows["big_full_publish_call_s"] > 0 and rows[f"big_lora{LORA_RANK}_publish_call_s"] > 0
