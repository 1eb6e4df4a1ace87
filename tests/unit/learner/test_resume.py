"""A learner's resumable checkpoint: the optimizer state round-trips by parameter name (any world size can load it),
older index-keyed ones still load, and the resumed run's optim.* settings apply."""

from __future__ import annotations

import torch

from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from learner.sections import LearnerSections
from learner.trainer import Learner

UNUSED_BUFFER = "tcp://127.0.0.1:9"  # these learners never fetch


def _learner(*overrides: str, resume_dir: str = "") -> Learner:
    cfg = load_config(None, ["model.path=builtin:micro", "quant.scheme=int8", *overrides])
    sections = to_dict(LearnerSections.pick(cfg))
    return Learner(sections, str(resolve_model_path(cfg.model.path)), UNUSED_BUFFER, resume_dir=resume_dir)


def _one_update(learner: Learner) -> None:
    params = [p for p in learner.model.parameters() if p.requires_grad]
    sum(p.pow(2).sum() for p in params).backward()
    learner.optimizer.step()
    learner.optimizer.zero_grad()


def _moments(learner: Learner) -> list[torch.Tensor]:
    return [learner.optimizer.state[p]["exp_avg_sq"] for p in learner.model.parameters()]


def test_resume_restores_the_optimizer_by_name_and_applies_the_new_optim_settings(tmp_path):
    first = _learner("optim.weight_decay=0.0")
    try:
        _one_update(first)
        first.save_checkpoint(str(tmp_path / "ckpt"))
        saved = torch.load(tmp_path / "ckpt" / "training_state.pt", weights_only=True)["optimizer"]
        assert all(isinstance(key, str) for key in saved["state"])  # by name: loadable at any world size
        expected = _moments(first)
    finally:
        first.close()
    resumed = _learner("optim.weight_decay=0.1", "optim.betas=[0.8,0.95]", resume_dir=str(tmp_path / "ckpt"))
    try:
        for mine, theirs in zip(_moments(resumed), expected):
            assert torch.equal(mine, theirs)
        group = resumed.optimizer.param_groups[0]
        assert group["weight_decay"] == 0.1 and tuple(group["betas"]) == (0.8, 0.95)
    finally:
        resumed.close()


def test_an_index_keyed_checkpoint_of_an_older_release_still_loads(tmp_path):
    first = _learner()
    try:
        _one_update(first)
        first.save_checkpoint(str(tmp_path / "ckpt"))
        path = tmp_path / "ckpt" / "training_state.pt"
        state = torch.load(path, weights_only=True)
        state["optimizer"] = first.optimizer.state_dict()  # what single-process learners used to save
        torch.save(state, path)
        expected = _moments(first)
    finally:
        first.close()
    resumed = _learner(resume_dir=str(tmp_path / "ckpt"))
    try:
        for mine, theirs in zip(_moments(resumed), expected):
            assert torch.equal(mine, theirs)
    finally:
        resumed.close()


def test_the_learner_steps_fused_and_a_checkpoint_of_the_loop_resumes_fused(tmp_path):
    first = _learner()
    try:
        assert first.optimizer.param_groups[0]["fused"] is True  # learner/optimizer.py: plain CPU fp32 parameters
        for group in first.optimizer.param_groups:  # what a learner of an older release stepped with
            group["fused"] = None
        _one_update(first)
        first.save_checkpoint(str(tmp_path / "ckpt"))
        saved = torch.load(tmp_path / "ckpt" / "training_state.pt", weights_only=True)["optimizer"]
        assert all(not group.get("fused") for group in saved["param_groups"])
        expected = _moments(first)
    finally:
        first.close()
    resumed = _learner(resume_dir=str(tmp_path / "ckpt"))
    try:
        assert all(group["fused"] is True for group in resumed.optimizer.param_groups)
        for mine, theirs in zip(_moments(resumed), expected):
            assert torch.equal(mine, theirs)
        _one_update(resumed)  # the fused kernel steps the loaded state
    finally:
        resumed.close()
