"""The learner's rollout-aligned operands reach the engine bit-identical, over the shm and the ZMQ paths."""

from __future__ import annotations

import pytest
import torch

from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from learner.aligned import aligned_layers
from learner.sections import LearnerSections
from learner.trainer import Learner
from quant_sync.quantizers import QuantizedWeight
from quant_sync.transport import WeightSubscriber
from rollout_workers.embedded.engine import EmbeddedEngine, build_weight_map


@pytest.mark.parametrize(("scheme", "use_shm"), [("int8", True), ("fp8", False)])
def test_engine_loads_exactly_the_operands_of_the_aligned_forward(scheme, use_shm):
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", "learner.rollout_aligned=true", f"quant.scheme={scheme}"])
    sections = to_dict(LearnerSections.pick(cfg))
    learner = Learner(sections, model_dir, "tcp://127.0.0.1:9")  # no buffer needed: only publication
    engine = EmbeddedEngine(model_dir)
    received = []
    subscriber = WeightSubscriber(
        learner.weights_endpoint(), lambda u: (received.append(u), engine.stage_weights(u)), 0.01, use_shm=use_shm
    )
    try:
        with torch.no_grad():
            for param in learner.model.parameters():
                param.add_(0.01)  # a new master weight: version 1 must carry freshly quantized operands
        learner._publish(1)
        assert subscriber.wait_for(1, 20) and subscriber.rejected == 0
        assert (subscriber.via_shm > 0) == use_shm
        assert engine.apply_staged() and engine.version == 1
        loaded = build_weight_map(received[-1])
        layers = dict(aligned_layers(learner.model))
        assert "lm_head" in layers  # quant.lm_head=auto: a W8A8 scheme on the embedded engine quantizes the head
        assert len(layers) == 7 * learner.model.config.num_hidden_layers + 1
        for name, layer in layers.items():
            operand = layer.operand()  # what the learner's next forward multiplies by
            engine_weight = loaded[name + ".weight"]
            assert isinstance(engine_weight, QuantizedWeight) and engine_weight.scheme == scheme
            assert engine_weight.q.dtype == operand.q.dtype
            assert torch.equal(engine_weight.q.view(torch.uint8), operand.q.view(torch.uint8)), name  # same bits
            assert torch.equal(engine_weight.scale, operand.scale), name
    finally:
        subscriber.close()
        learner.close()
