"""The package layers hold: `common` -> `buffer`, `quant_sync` -> `learner`, `rollout_workers` -> `asyncrl`.

`lint-imports` checks pyproject's layers contract over every import, function-local ones included; the ground
package stays free of torch at import time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("common", "buffer", "quant_sync", "learner", "rollout_workers", "asyncrl")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _copy_tree(dst: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_layers_contract_is_kept() -> None:
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("common/wire.py", "import learner.losses\n"),
        ("buffer/state.py", "def _later():\n    from asyncrl import driver\n"),  # function-local imports count
        ("quant_sync/uaq.py", "from buffer import client\n"),  # siblings in one layer are independent
        ("learner/losses.py", "from rollout_workers import worker\n"),
    ],
)
def test_an_import_up_the_layers_fails_the_check(tmp_path: Path, module: str, line: str) -> None:
    root = _copy_tree(tmp_path)
    with open(root / module, "a") as handle:
        handle.write("\n" + line)
    result = _lint_imports(root)
    assert result.returncode != 0
    assert "0 kept, 1 broken" in result.stdout, result.stdout + result.stderr


def test_the_ground_package_imports_without_torch() -> None:
    modules = sorted(
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for path in (REPO / "common").rglob("*.py")
    )
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print(sorted(m for m in sys.modules"
    code += " if m.split('.')[0] in ('torch', 'ray', 'transformers', 'asyncrl', 'learner', 'rollout_workers')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"common/ pulled in: {result.stdout}"
    assert len(modules) >= 10


def test_the_driver_creates_its_actors_without_importing_torch() -> None:
    """The driver imports what `asyncrl up` imports to create the learner and worker actors (their classes are
    pickled by reference); torch and transformers load in the actors' processes only (start-up CPU, issue 27)."""
    code = (
        "import sys, ray\n"
        "import asyncrl.cli, asyncrl.driver, asyncrl.evaluate, learner.group, rollout_workers.worker\n"
        "from common.config import load_config\n"
        "from learner.sections import LearnerSections\n"
        "cfg = load_config('configs/dapo_int8.yaml', [])\n"
        "ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)\n"
        "group = learner.group.LearnerGroup(LearnerSections.pick(cfg), cfg.ray, '/nonexistent', 'tcp://127.0.0.1:9')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'datasets')))\n"
        "ray.shutdown()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"the driver pulled in: {result.stdout}"
