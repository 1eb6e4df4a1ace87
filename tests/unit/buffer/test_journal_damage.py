"""Journal damage: a torn tail is cut as a crash leaves it; damage with intact records after it keeps those records.

Before, one flipped byte in the middle (or in the magic) cut every record after it from the file for good, and a
resume then trained the same prompts again without a word; a journal behind the checkpoint was taken as it was.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_service import ROOT, lease_and_push, running_buffer

from buffer.journal import MAGIC, Journal, read_records

RECORDS = [{"k": "lease", "i": [index], "x": []} for index in range(8)]


def write_journal(path: Path) -> list[int]:
    """The journal of RECORDS; returns each record's start offset."""
    journal = Journal(path, "always")
    for record in RECORDS:
        journal.append(record)
    journal.close()
    offsets, data, at = [], path.read_bytes(), len(MAGIC)
    while at < len(data):
        offsets.append(at)
        at += 12 + int.from_bytes(data[at : at + 4], "little")
    assert len(offsets) == len(RECORDS)
    return offsets


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_record_in_the_middle_loses_only_itself_and_the_original_is_kept(tmp_path: Path, capsys) -> None:
    path = tmp_path / "buffer.journal"
    offsets = write_journal(path)
    original = path.read_bytes()
    flip(path, offsets[3] + 14)  # inside the fourth record's payload
    damaged = path.read_bytes()
    assert read_records(path) == RECORDS[:3] + RECORDS[4:]
    said = capsys.readouterr().err
    assert f"buffer journal: {path} is damaged ({offsets[4] - offsets[3]} bytes at offset {offsets[3]})" in said
    assert "7 intact records kept" in said and f"saved as {path}.damaged" in said
    assert (tmp_path / "buffer.journal.damaged").read_bytes() == damaged != original
    assert read_records(path) == RECORDS[:3] + RECORDS[4:]  # rewritten whole: read again, nothing to say
    assert capsys.readouterr().err == ""


def test_a_damaged_magic_keeps_every_record(tmp_path: Path, capsys) -> None:
    path = tmp_path / "buffer.journal"
    write_journal(path)
    flip(path, 3)
    assert read_records(path) == RECORDS  # it was read as version 1, and the whole journal was cut
    assert "is damaged (the magic)" in capsys.readouterr().err
    assert path.read_bytes().startswith(MAGIC)


def test_a_torn_or_zeroed_tail_is_cut_as_before_and_nothing_is_saved_aside(tmp_path: Path, capsys) -> None:
    path = tmp_path / "buffer.journal"
    write_journal(path)
    whole = path.read_bytes()
    for tail in (b"\x40\x00\x00\x00torn", bytes(8192), whole[len(MAGIC) : len(MAGIC) + 20]):
        path.write_bytes(whole + tail)
        assert read_records(path) == RECORDS
        assert path.read_bytes() == whole
        assert f"truncating {len(tail)} torn bytes" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.damaged*"))


def test_a_resume_on_a_journal_behind_its_checkpoint_is_refused_and_the_journal_left_as_it_is(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with running_buffer(tmp_path, run_dir=run_dir) as buffer:
        lease_and_push(buffer, 4)
        for step in (0, 1):
            assert buffer.client.fetch_batch(step=step, num_groups=2, wait_s=0.0).ready
    before = (run_dir / "buffer.journal").read_bytes()
    config = tmp_path / "config.json"  # written by running_buffer

    def resume_at_5() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "buffer", "--config-json", str(config), "--run-dir",
                               str(run_dir), "--resume-step", "5"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    (run_dir / "checkpoints" / "step_5").mkdir(parents=True)  # the one the resume asks for, and an older one
    (run_dir / "checkpoints" / "step_3").mkdir()
    done = resume_at_5()
    assert done.returncode == 2, done.stderr
    assert (
        f"buffer: the journal {run_dir / 'buffer.journal'} records batches up to train step 1, but the checkpoint the "
        "run resumes from trained up to step 4" in done.stderr
    )
    assert ("move step_3, step_5 (the checkpoints after step_2) out of its checkpoints/ directory: the resume then "
            "starts from the initial model (no checkpoint the journal covers)") in done.stderr  # fmt: skip
    (run_dir / "checkpoints" / "step_1").mkdir()  # one the journal covers: the advice names it as the new start
    done = resume_at_5()
    assert done.returncode == 2, done.stderr
    assert "move step_3, step_5 (the checkpoints after step_2) out of its checkpoints/ directory: the resume then " \
           "starts from its checkpoint step_1" in done.stderr  # fmt: skip
    assert (run_dir / "buffer.journal").read_bytes() == before  # no rewind record
    with running_buffer(tmp_path, run_dir=run_dir, args=("--resume-step", "2")) as buffer:  # a checkpoint it covers
        assert buffer.stats()["consumed_groups"] == 4
