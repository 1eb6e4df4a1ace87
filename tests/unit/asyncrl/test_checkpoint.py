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
