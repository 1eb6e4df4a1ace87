"""`buffer.run_keys`: a run without CurveZMQ keys of the user's gets fresh ones of its own, private to its user."""

from __future__ import annotations

import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from asyncrl.driver import StartupError, _use_run_keys
from common.config import load_config
from common.curve import client_keys, server_keys


def test_a_default_run_gets_private_keys_that_admit_its_own_clients() -> None:
    cfg, again = load_config(None, []), load_config(None, [])
    keys_dir, other = _use_run_keys(cfg), _use_run_keys(again)  # every run its own
    try:
        assert keys_dir is not None and cfg.buffer.curve_keys_dir == str(keys_dir)
        assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
        server, client = server_keys(str(keys_dir)), client_keys(str(keys_dir))
        assert server is not None and client is not None
        assert client.server_public == server.public
        allowed = {path.read_bytes() for path in server.allowed_dir.glob("*.key")}
        assert any(client.public in text for text in allowed)
        assert other is not None and client_keys(str(other)).public != client.public
    finally:
        for path in (keys_dir, other):
            if path is not None:
                shutil.rmtree(path)


@pytest.mark.parametrize("overrides", [["buffer.run_keys=false"], ["buffer.curve_keys_dir=/somewhere/keys"]])
def test_no_run_keys_when_turned_off_or_the_user_has_keys(overrides: list[str]) -> None:
    cfg = load_config(None, overrides)
    before = cfg.buffer.curve_keys_dir
    assert _use_run_keys(cfg) is None and cfg.buffer.curve_keys_dir == before


def test_keys_that_cannot_be_written_are_a_startup_error_naming_the_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    with pytest.raises(StartupError, match=r"buffer\.run_keys: cannot write the run's CurveZMQ keys"):
        _use_run_keys(load_config(None, []))


def test_keys_a_killed_driver_left_behind_are_swept_and_a_live_drivers_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from common.curve import RUN_KEYS_PREFIX, sweep_run_keys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = tmp_path / f"{RUN_KEYS_PREFIX}{gone.stdout.strip()}-abc", tmp_path / f"{RUN_KEYS_PREFIX}1-xyz"
    other = tmp_path / "asyncrl-keys-notapid-x"  # not ours to judge
    for path in (dead, live, other):
        (path / "clients").mkdir(parents=True)
    assert sweep_run_keys(tmp_path) == [dead]  # pid 1 runs; the short-lived child's pid is gone
    assert not dead.exists() and live.is_dir() and other.is_dir()
