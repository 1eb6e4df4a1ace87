"""`output_file_problem`: what keeps an output file from being written, found before the work that fills it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.fsutil import output_file_problem, write_failure


def test_a_writable_path_has_no_problem_and_gets_its_parent_directories(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out.json"
    assert output_file_problem(str(target)) is None
    assert target.parent.is_dir() and not target.exists()  # only the directories are made
    target.write_text("{}")
    assert output_file_problem(str(target)) is None  # an existing file is overwritten


def test_each_problem_is_named(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert output_file_problem("") == "the path is empty"
    assert output_file_problem(str(tmp_path)) == f"{tmp_path} is a directory"
    assert output_file_problem(str(a_file / "x" / "out.json")) == f"{a_file} is not a directory"
    assert output_file_problem("/proc/no-such-dir/out.json").startswith("cannot create its directory /proc/no-such-dir")


@pytest.mark.parametrize("path", ["/dev/null/bench.json", "/proc/no-such-dir/bench.json"])
def test_bench_refuses_a_json_path_it_could_not_write_before_it_runs(path: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "bench", "wire", "--json", path],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"asyncrl bench: --json {path}: ") and proc.stdout == ""  # no table: nothing ran


def test_a_write_that_fails_after_the_check_gives_the_systems_reason(tmp_path: Path) -> None:
    target = tmp_path / "gone" / "out.json"
    assert output_file_problem(str(target)) is None
    target.parent.rmdir()  # removed while the measurement ran
    assert write_failure(lambda: target.write_text("{}")) == "No such file or directory"
    target.parent.mkdir()
    assert write_failure(lambda: target.write_text("{}")) is None and target.read_text() == "{}"
