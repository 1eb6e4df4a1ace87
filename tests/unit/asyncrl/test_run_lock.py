"""The run lock: one driver per run directory; a second `--resume` is refused before it writes anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl import run_lock
from asyncrl.driver import StartupError, _resume_lock, new_run_dir
from common.config import load_config

HOLD = "import sys; from pathlib import Path; from asyncrl import run_lock; run_lock.acquire(Path(sys.argv[1])); " \
       "print('held', flush=True); sys.stdin.read()"  # fmt: skip


def hold(run_dir: Path) -> subprocess.Popen:
    """Another process holding `run_dir`'s lock until its stdin closes (or it is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_run_held_by_a_live_driver_is_refused_naming_it_and_free_once_it_is_killed(tmp_path: Path) -> None:
    holder = hold(tmp_path)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(StartupError) as caught:
        _resume_lock(tmp_path)
    assert str(caught.value).startswith(f"--resume {tmp_path}: the run is running (its driver is pid {holder.pid})")
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before  # nothing written
    holder.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel drops the lock
    holder.wait()
    lock = _resume_lock(tmp_path)
    assert (tmp_path / run_lock.LOCK_FILE).read_text().strip() == str(os.getpid())
    lock.release()
    again = _resume_lock(tmp_path)  # a released lock can be taken again
    again.release()


def test_a_new_run_never_takes_a_directory_another_driver_holds(tmp_path: Path, monkeypatch) -> None:
    config = load_config(None, [f"logging.dir={tmp_path}", "logging.name=r"])
    (tmp_path / "r").mkdir()
    holder = hold(tmp_path / "r")  # it made the directory and locked it, and has written nothing else yet
    try:
        run_dir, lock = new_run_dir(config)
    finally:
        holder.stdin.close()
        holder.wait()
    assert run_dir == tmp_path / "r-2"
    lock.release()
    taken = [tmp_path / "r-3"]  # the race: another driver locks the empty directory this one has just chosen
    real = run_lock.acquire

    def raced(path: Path) -> run_lock.RunLock:
        if path in taken:
            taken.remove(path)
            (path / "config.json").touch()  # what the other driver writes next
            raise run_lock.RunLocked(path, 1)
        return real(path)

    monkeypatch.setattr(run_lock, "acquire", raced)
    run_dir, lock = new_run_dir(config)
    assert run_dir == tmp_path / "r-4"
    lock.release()


def test_resume_auto_does_not_start_a_second_run_beside_a_running_one(tmp_path: Path, capsys) -> None:
    """Re-run by a scheduler while the config's newest run was running and had no checkpoint yet, `--resume auto`
    started a new run each time: three runs of one config trained at once."""
    from asyncrl.cli import _auto_resume

    config = load_config(None, [f"logging.dir={tmp_path}", "logging.name=r"])
    run_dir, lock = new_run_dir(config)
    lock.release()
    holder = hold(run_dir)
    try:
        assert run_lock.holder(run_dir) == holder.pid
        assert _auto_resume(config) == ""
        assert f"--resume auto: {run_dir} is running (its driver is pid {holder.pid})" in capsys.readouterr().err
    finally:
        holder.stdin.close()
        holder.wait()
    assert run_lock.holder(run_dir) is None
    assert _auto_resume(config) is None  # not running, no checkpoint: a new run, as before
