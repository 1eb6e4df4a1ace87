"""The built-in model cache: a damaged copy is rebuilt, builds killed midway are cleaned up, others can read it."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from common.builtin_model import BUILT_FILES, resolve_model_path


def test_a_damaged_cached_model_is_rebuilt_and_abandoned_builds_are_removed(tmp_path: Path) -> None:
    built = resolve_model_path("builtin:micro", cache_dir=str(tmp_path), log=lambda *a: None)
    assert all((built / name).is_file() for name in BUILT_FILES)
    assert stat.S_IMODE(built.stat().st_mode) == 0o755  # a shared cache: readable by every user
    (built / "tokenizer.json").unlink()  # a copy cut short, or a file removed by hand
    abandoned = built.parent / ".micro-killedbuild"  # the staging directory of a build killed two hours ago
    abandoned.mkdir()
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))
    fresh = built.parent / ".micro-inprogress"  # one that another process is writing right now: kept
    fresh.mkdir()
    again = resolve_model_path("builtin:micro", cache_dir=str(tmp_path), log=lambda *a: None)
    assert again == built and all((again / name).is_file() for name in BUILT_FILES)
    assert not abandoned.exists() and fresh.exists()
    left = sorted(p.name for p in built.parent.iterdir() if not p.name.endswith(".lock"))  # the build's lock file
    assert left == sorted([built.name, fresh.name])


def test_two_processes_asking_for_the_same_model_build_it_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from common.builtin_model import resolve_model_path\n"
        "print(resolve_model_path('builtin:micro', sys.argv[1], log=lambda m: print('LOG', m)))\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert sum(out.count("LOG building") for out in outputs) == 1, outputs  # the other waited, then reused it
    assert len({out.strip().splitlines()[-1] for out in outputs}) == 1  # the same directory for both


def test_a_cache_that_cannot_hold_the_build_is_named_with_the_way_around_it(tmp_path: Path) -> None:
    """A read-only HOME gave a 36-line traceback ending in `OSError: [Errno 30] ... .cache`."""
    import pytest

    from common.builtin_model import resolve_model_path

    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache should be")
    with pytest.raises(ValueError) as caught:
        resolve_model_path("builtin:micro", str(not_a_dir))
    assert str(caught.value).startswith(f"model.path=builtin:micro: cannot build it in {not_a_dir / 'builtin'}: ")
    assert str(caught.value).endswith("set model.cache_dir (or $ASYNCRL_CACHE) to a writable directory")
