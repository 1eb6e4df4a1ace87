"""Checkpoint directories: written under a temporary name and renamed, so `latest` only ever sees complete ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asyncrl import checkpoint


def _writer(content: str):
    def write(out_dir: str) -> None:
        (Path(out_dir) / "model.bin").write_text(content)

    return write


def test_saving_keeps_the_newest_and_latest_is_complete(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, step, _writer(f"weights {step}"), {"note": step}, keep_last=2)
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step_4", "step_6"]
    latest = checkpoint.latest(tmp_path)
    assert latest is not None and checkpoint.read_meta(latest) == {"step": 6, "note": 6}


def test_a_crash_while_saving_the_same_step_again_never_leaves_a_half_deleted_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint.save(tmp_path, 4, _writer("weights 4"), {}, keep_last=3)
    checkpoint.save(tmp_path, 5, _writer("periodic 5"), {}, keep_last=3)
    deleted: list[str] = []

    def dying_rmtree(path, *args, **kwargs):  # the process is killed partway through deleting a directory
        deleted.append(Path(path).name)
        (Path(path) / "model.bin").unlink(missing_ok=True)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 5, _writer("final 5"), {}, keep_last=3)  # `down` right after the periodic save
    latest = checkpoint.latest(tmp_path)
    assert latest is not None and latest.name == "step_5" and deleted == [".step_5.old.tmp"]
    assert (latest / "model.bin").read_text() == "final 5"  # complete: the replaced copy was the one being deleted


def test_a_resave_after_a_crash_mid_resave_clears_what_that_crash_left(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 5, _writer("periodic 5"), {}, keep_last=3)
    leftover = tmp_path / checkpoint.CHECKPOINTS / ".step_5.old.tmp"
    leftover.mkdir(parents=True)
    (leftover / "model.bin").write_text("half deleted")
    checkpoint.save(tmp_path, 5, _writer("final 5"), {}, keep_last=3)
    latest = checkpoint.latest(tmp_path)
    assert latest is not None and (latest / "model.bin").read_text() == "final 5"
    assert not leftover.exists()


def test_pruning_killed_midway_leaves_nothing_that_outlives_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL while the oldest checkpoint is deleted (seen in CI: `test_driver_killed_then_resumed...` kept a
    step_2 without meta.json, which no listing showed and no later save pruned)."""
    for step in (2, 4):
        checkpoint.save(tmp_path, step, _writer(f"weights {step}"), {}, keep_last=2)
    root = tmp_path / checkpoint.CHECKPOINTS
    real_rmtree = shutil.rmtree

    def dying_rmtree(path, *args, **kwargs):  # killed partway through pruning: meta.json gone, the rest still there
        if not Path(path).name.endswith(".del.tmp"):
            return real_rmtree(path, *args, **kwargs)
        (Path(path) / checkpoint.META).unlink(missing_ok=True)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 6, _writer("weights 6"), {}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == [".step_2.del.tmp", "step_4", "step_6"]
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    half_deleted = root / "step_1"  # what a kill mid-deletion left before deletions were renamed first
    half_deleted.mkdir()
    (half_deleted / "model.bin").write_text("weights 1")
    checkpoint.save(tmp_path, 8, _writer("weights 8"), {}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_6", "step_8"]


def _real_writer(out_dir: str) -> None:
    """What the learner writes: a Hugging Face model directory and a torch.save archive of the training state."""
    import torch

    from common.builtin_model import resolve_model_path

    shutil.copytree(resolve_model_path("builtin:micro"), Path(out_dir) / "model")
    torch.save({"optimizer": {"step": torch.arange(3.0) + 0.5}}, Path(out_dir) / checkpoint.TRAINING_STATE)


def _truncate(path: Path, keep: int) -> None:
    with path.open("r+b") as handle:
        handle.truncate(keep)


DAMAGE = {
    "meta.json is not json": (lambda d: (d / "meta.json").write_text("{not json"), "meta.json cannot be read as JSON"),
    "meta.json without a step": (lambda d: (d / "meta.json").write_text("{}"), "its step is None, not 6"),
    "meta.json of another step": (lambda d: (d / "meta.json").write_text('{"step": 5}'), "its step is 5, not 6"),
    "no meta.json": (lambda d: (d / "meta.json").unlink(), "meta.json is missing"),
    "weights truncated": (lambda d: _truncate(d / "model" / "model.safetensors", 5000),
                          "model.safetensors is truncated"),
    "no model": (lambda d: shutil.rmtree(d / "model"), "model is missing"),
    "training state truncated": (lambda d: _truncate(d / "training_state.pt", 300),
                                 "training_state.pt is not a whole torch.save archive"),
    "no training state": (lambda d: (d / "training_state.pt").unlink(), "training_state.pt is missing"),
    "training state bytes flipped": (lambda d: _flip(d / "training_state.pt"), "fails its CRC-32 check"),
    "config.json cut short": (lambda d: _truncate(d / "model" / "config.json", 100), "config.json cannot be read"),
    "no config.json": (lambda d: (d / "model" / "config.json").unlink(), "config.json is missing"),
}  # fmt: skip


def _flip(path: Path) -> None:
    """Bytes flipped inside the tensor data, the zip directory whole (torch.load took it, and the next update wrote
    NaNs into the weights from the damaged AdamW moments)."""
    import torch

    data = bytearray(path.read_bytes())
    stored = torch.load(path)["optimizer"]["step"].numpy().tobytes()
    at = data.index(stored)
    data[at : at + 8] = bytes(byte ^ 0xFF for byte in data[at : at + 8])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_passed_over_for_the_newest_whole_one(tmp_path: Path, fault: str) -> None:
    """They gave tracebacks (meta.json) or failed in the learner naming no file, with advice to resume from the same
    checkpoint, which failed again; one without meta.json was passed over without a word."""
    for step in (4, 6):
        checkpoint.save(tmp_path, step, _real_writer, {}, keep_last=2)
    assert checkpoint.damage(tmp_path / "checkpoints" / "step_6") == ""
    damage, expected = DAMAGE[fault]
    damage(tmp_path / "checkpoints" / "step_6")
    said: list[str] = []
    assert checkpoint.latest_whole(tmp_path, say=said.append) == tmp_path / "checkpoints" / "step_4"
    assert len(said) == 1 and said[0].startswith("checkpoint step_6 passed over: ") and expected in said[0], said
    assert str(tmp_path / "checkpoints" / "step_6") in said[0]  # the file, by its path
    assert (tmp_path / "checkpoints" / "step_6").is_dir()  # never deleted


def test_lora_checkpoints_are_checked_by_their_adapter_file(tmp_path: Path) -> None:
    def adapters(out_dir: str) -> None:
        _real_writer(out_dir)
        model = Path(out_dir) / "model"
        (model / "model.safetensors").rename(model / "adapter_model.safetensors")
        (model / "adapter_config.json").write_text("{}")

    checkpoint.save(tmp_path, 3, adapters, {}, keep_last=1)
    step = tmp_path / "checkpoints" / "step_3"
    assert checkpoint.damage(step) == ""
    _truncate(step / "model" / "adapter_model.safetensors", 5000)
    assert "adapter_model.safetensors is truncated" in checkpoint.damage(step)


def test_a_damaged_newer_checkpoint_never_counts_among_the_kept_ones(tmp_path: Path) -> None:
    """A resume passed over a damaged step_62 for step_60; with keep_last=1, saving step_61 deleted both step_60 and
    step_61 (the damaged step_62 ranked newest), so the next resume fell back to the initial model."""
    root = tmp_path / "checkpoints"
    for step in (60, 62):
        checkpoint.save(tmp_path, step, _real_writer, {}, keep_last=2)
    _truncate(root / "step_62" / "model" / "model.safetensors", 5000)
    assert checkpoint.latest_whole(tmp_path) == root / "step_60"  # the resume's choice
    checkpoint.save(tmp_path, 61, _real_writer, {}, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_61", "step_62"]  # step_60 pruned; the damaged one left
    assert checkpoint.latest_whole(tmp_path) == root / "step_61"
    checkpoint.save(tmp_path, 62, _real_writer, {}, keep_last=1)  # the run reaches the damaged step: replaced
    assert sorted(p.name for p in root.iterdir()) == ["step_62"] and checkpoint.damage(root / "step_62") == ""
