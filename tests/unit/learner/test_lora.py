"""LoRA on a frozen quantized base (learner/lora.py): only the adapters train, the base is published once, later
versions carry the adapters alone, and the learner's log-probs on the rollout-aligned base equal the engine's."""

from __future__ import annotations

import pytest
import torch
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from common.builtin_model import resolve_model_path
from common.config import ConfigError, load_config, to_dict
from learner import lora
from learner.acrl import AcrlReference
from learner.aligned import AlignedLinear, aligned_layers, full_precision
from learner.precision import LossScaler
from learner.sections import LearnerSections
from learner.trainer import Learner
from learner.update import train_on_batch
from quant_sync.export import pack_adapters
from quant_sync.transport import WeightSubscriber
from rollout_workers.embedded.engine import EmbeddedEngine
from rollout_workers.engine import SamplingParams

PROMPTS = [[1, 4, 5, 13, 6, 7, 15], [1, 9, 14, 3, 15]]


def _learner(*overrides: str) -> tuple[Learner, str]:
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", "model.lora.rank=4", "quant.scheme=int8", *overrides])
    return Learner(to_dict(LearnerSections.pick(cfg)), model_dir, "tcp://127.0.0.1:9"), model_dir  # no buffer


@torch.no_grad()
def _perturb_adapters(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> None:
    """Nonzero adapters (peft starts B at zero), as after some training."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.add_(scale * torch.randn(param.shape, generator=gen))


@torch.no_grad()
def _logp(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([prompt + response])).logits[0].float().log_softmax(-1)
    return out[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None]).squeeze(1)


def _max_gap(model: torch.nn.Module, completions) -> float:
    gaps = [
        float((_logp(model, prompt, c.response_ids) - torch.tensor(c.behav_logp)).abs().max())
        for prompt, c in zip(PROMPTS, completions)
    ]
    return max(gaps)


def test_only_the_adapters_train_on_the_rollout_aligned_base():
    learner, _ = _learner()
    try:
        model = learner.model
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in name for name in trainable)
        layers = dict(aligned_layers(model))  # the frozen base runs the published operands (lora_base=auto: rollout)
        assert len(layers) == 7 * model.config.num_hidden_layers + 1  # decoder linears and the quantized head
        assert all(isinstance(layer, AlignedLinear) and not layer.weight.requires_grad for layer in layers.values())
        assert len(lora.lora_layers(model)) == 7 * model.config.num_hidden_layers
    finally:
        learner.close()


def test_a_lora_step_moves_the_adapters_and_nothing_else():
    model = tiny_model()
    reference = tiny_model()
    cfg = tiny_config("model.lora.rank=4", "quant.scheme=int8")
    sections = LearnerSections.pick(load_config(None, ["model.lora.rank=4", "quant.scheme=int8"]))
    model, publication = lora.add_adapters(model, sections, quantized_head=False)
    assert publication.aligned_base
    _perturb_adapters(model)  # B = 0 would give A no gradient in the first step
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = with_behavior(tiny_batch(), reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    assert not result.skipped and result.metrics["norm_update"] > 0
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all("lora_" in name for name in moved)
    assert any("lora_A" in name for name in moved) and any("lora_B" in name for name in moved)
    with_state = {name for name, p in model.named_parameters() if p in optimizer.state}
    assert with_state and all("lora_" in name for name in with_state)  # no AdamW moments for the frozen base


@pytest.mark.parametrize(
    ("use_shm", "sync_dtype"), [(True, "fp32"), (False, "fp32"), (True, "int8"), (False, "bf16")],
    ids=["shm-fp32", "zmq-fp32", "shm-int8", "zmq-bf16"],
)  # fmt: skip
def test_learner_logp_equals_the_engines_with_adapters_and_late_workers_catch_up(use_shm, sync_dtype):
    """With the base quantized (int8) and lora_base=rollout, the learner's fp32 log-probs equal the engine's to 1e-5
    with nonzero adapters; later versions carry only the adapters; a worker that joins late gets base + adapters.
    With adapters sent in int8 or bf16 (`model.lora.sync_dtype`) the learner runs the very rounded values."""
    learner, model_dir = _learner(f"model.lora.sync_dtype={sync_dtype}")
    engines, subscribers = [EmbeddedEngine(model_dir, seed=0)], []
    try:
        subscribers.append(
            WeightSubscriber(learner.weights_endpoint(), engines[0].stage_weights, 0.01, use_shm=use_shm)
        )
        assert subscribers[0].wait_for(0, 20)
        full_bytes = sum(t.nbytes for t in subscribers[0].base.tensors.values())
        _perturb_adapters(learner.model)
        metrics = learner._publish(1)
        adapter_bytes = sum(t.nbytes for t in lora.adapter_tensors(learner.model, sync_dtype).values())
        packed_bytes = sum(t.nbytes for t in pack_adapters(lora.adapter_tensors(learner.model, sync_dtype)).values())
        assert metrics["sync/bytes_per_version"] == packed_bytes < full_bytes / 2  # the adapters alone travel (packed)
        fp32_bytes = sum(t.nbytes for t in lora.adapter_tensors(learner.model).values())
        assert adapter_bytes <= {"fp32": 1.0, "bf16": 0.55, "int8": 0.3}[sync_dtype] * fp32_bytes
        assert metrics["lora/norm_B"] > 0 and metrics["sync/publish_s"] > 0 and "norm_quant_err" in metrics
        assert subscribers[0].wait_for(1, 20) and subscribers[0].rejected == 0
        assert engines[0].apply_staged() and engines[0].version == 1
        assert engines[0]._weights.layers[0].qkv_lora is not None
        params = SamplingParams(max_new_tokens=10, seed=1)
        completions = engines[0].generate(PROMPTS, params)
        assert all(v == 1 for c in completions for v in c.versions)
        aligned_gap = _max_gap(learner.model, completions)
        with full_precision(learner.model):  # lora_base=full: the same adapters on the fp32 base
            full_gap = _max_gap(learner.model, completions)
        with learner.model.disable_adapter():  # the adapters matter: without them the log-probs move
            no_adapter_gap = _max_gap(learner.model, completions)
        print(f"lora gaps: aligned {aligned_gap:.2e}, fp32 base {full_gap:.2e}, no adapters {no_adapter_gap:.2e}")
        assert aligned_gap <= 1e-5 and full_gap > 100 * aligned_gap and no_adapter_gap > 100 * aligned_gap, (
            aligned_gap, full_gap, no_adapter_gap)  # fmt: skip
        rounded = [m for m in learner.model.modules() if isinstance(m, lora.RoundedLinear)]
        assert len(rounded) == (0 if sync_dtype == "fp32" else 2 * len(lora.lora_layers(learner.model)))
        assert lora.round_adapters(learner.model, sync_dtype) == len(rounded)  # again: the same ones, none added
        if rounded:  # the rounding matters: the fp32 masters' forward misses the engine by far more than 1e-5
            for module in rounded:
                module.sync_dtype = "fp32"
            master_gap = _max_gap(learner.model, completions)
            for module in rounded:
                module.sync_dtype = sync_dtype
            print(f"lora {sync_dtype}: the fp32 masters' gap {master_gap:.2e}")
            assert master_gap > 10 * max(aligned_gap, 1e-7), (master_gap, aligned_gap)

        _perturb_adapters(learner.model, seed=1)
        learner._publish(2)
        engines.append(EmbeddedEngine(model_dir, seed=0))  # a worker that joins (or restarts) at version 2
        subscribers.append(
            WeightSubscriber(learner.weights_endpoint(), engines[1].stage_weights, 0.01, use_shm=use_shm)
        )
        for subscriber, engine in zip(subscribers, engines):
            assert subscriber.wait_for(2, 20) and subscriber.rejected == 0
            assert engine.apply_staged() and engine.version == 2
        assert subscribers[1].base is not None and subscribers[1].base.version == 0  # fetched the pinned base
        late, running = (engine.generate(PROMPTS, params) for engine in reversed(engines))
        for a, b in zip(late, running):
            assert a.response_ids == b.response_ids and a.behav_logp == b.behav_logp and set(a.versions) == {2}
        # The learner runs the adapters through torch's GEMMs, the engine through csrc/lora_gemm.cpp: fp32 sums in
        # different orders; a W8A8 activation within an ulp of a rounding boundary (the likely cause, not traced)
        # then rounds differently on the two sides, and a gap of a few 1e-5 appears (4.1e-5 on an Intel AMX Xeon,
        # 2026-12-03; 0 with ASYNCRL_ISA_CAP=avx2, torch on both sides): still 37x below the fp32 base's gap above.
        assert _max_gap(learner.model, late) <= min(1e-4, full_gap / 10)
    finally:
        for subscriber in subscribers:
            subscriber.close()
        learner.close()


@pytest.mark.parametrize("sync_dtype", ["fp32", "int8"])
def test_resume_restores_the_adapters_and_final_is_a_peft_directory_of_the_original_model(tmp_path, sync_dtype):
    """int8 adapters: final/ holds the rounded values the model ran (peft gives its log-probs) and the fp32 masters
    beside them, which resume restores."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    overrides = (f"model.lora.sync_dtype={sync_dtype}",)
    learner, model_dir = _learner(*overrides)  # quant.uaq.scale = 1.5: the saved A of q/k/v/gate/up carry the factor
    try:
        _perturb_adapters(learner.model)
        for param in learner.model.parameters():
            if param.requires_grad:
                param.grad = torch.ones_like(param)
        learner.optimizer.step()  # AdamW moments to restore
        learner.save_checkpoint(str(tmp_path / "ckpt"))
        learner.save(str(tmp_path / "final"))
        trained = {name: p.detach().clone() for name, p in learner.model.named_parameters() if "lora_" in name}
        moments = {name: learner.optimizer.state[p]["exp_avg"].clone() for name, p in learner.model.named_parameters()
                   if p in learner.optimizer.state}  # fmt: skip
        prompt, response = PROMPTS[0], [5, 6, 7, 8]
        trained_logp = _logp(learner.model, prompt, response)
        with full_precision(learner.model):
            trained_fp32_logp = _logp(learner.model, prompt, response)
    finally:
        learner.close()
    assert (tmp_path / "final" / "adapter_config.json").is_file() and not (tmp_path / "final" / "config.json").exists()
    assert (tmp_path / "final" / lora.MASTER_FILE).is_file() == (sync_dtype != "fp32")
    cfg = load_config(None, ["model.path=builtin:micro", "model.lora.rank=4", "quant.scheme=int8", *overrides])
    checkpoint = str(tmp_path / "ckpt")
    resumed = Learner(
        to_dict(LearnerSections.pick(cfg)), model_dir, "tcp://127.0.0.1:9", resume_dir=checkpoint, start_version=1
    )
    try:
        for name, param in resumed.model.named_parameters():
            if "lora_" in name:  # A of q/k/v/gate/up went through x 1.5 and / 1.5: fp32 rounding at most
                torch.testing.assert_close(param.detach(), trained[name], rtol=2e-7, atol=0)
            if param in resumed.optimizer.state:
                assert torch.equal(resumed.optimizer.state[param]["exp_avg"], moments[name])
        assert set(moments) == {name for name, p in resumed.model.named_parameters() if p in resumed.optimizer.state}
        torch.testing.assert_close(_logp(resumed.model, prompt, response), trained_logp, rtol=0, atol=1e-5)
    finally:
        resumed.close()
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # no UAQ: the user's model
    loaded = PeftModel.from_pretrained(original, str(tmp_path / "final"))
    torch.testing.assert_close(_logp(loaded, prompt, response), trained_fp32_logp, rtol=0, atol=1e-5)
    merged_dir = lora.merge_adapters(model_dir, tmp_path / "final", tmp_path / "final-merged")  # merge_lora
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters()) and merged_dir.endswith("final-merged")
    torch.testing.assert_close(_logp(merged, prompt, response), trained_fp32_logp, rtol=0, atol=1e-5)
    assert (tmp_path / "final-merged" / "tokenizer_config.json").is_file()
    assert not (tmp_path / "final-merged" / lora.MASTER_FILE).exists()
    with pytest.raises(FileNotFoundError, match="not a peft adapter directory"):
        lora.merge_adapters(model_dir, tmp_path / "final-merged", tmp_path / "again")


def test_lora_config_rules():
    load_config(None, ["model.lora.rank=8", "learner.world_size=2"])  # LoRA under FSDP2 (test_lora_fsdp.py)
    with pytest.raises(ConfigError, match="model.lora.sync_dtype"):
        load_config(None, ["model.lora.rank=8", "model.lora.sync_dtype=fp8"])
    with pytest.raises(ConfigError, match="lora_base=rollout"):
        load_config(None, ["model.lora.rank=8", "quant.scheme=none", "learner.lora_base=rollout"])
    with pytest.raises(ConfigError, match="merge_lora=true"):
        load_config(None, ["checkpoint.merge_lora=true"])
    load_config(None, ["model.lora.rank=8", "checkpoint.merge_lora=true"])
    with pytest.raises(ConfigError, match="model.lora.targets"):
        load_config(None, ["model.lora.targets=[q_proj,lm_head]"])
    with pytest.raises(ConfigError, match="lora_base=rollout"):
        load_config(None, ["model.lora.rank=8", "learner.rollout_aligned=true", "learner.lora_base=full"])
    cfg = load_config(None, ["model.lora.rank=8", "quant.scheme=none"])  # auto: the fp32 base
    from common.config_rules import lora_base

    assert lora_base(cfg.learner, cfg.quant) == "full"
