"""Resumable checkpoints of a run: runs/<name>/checkpoints/step_<k>/, written atomically, the last N kept.

    step_<k>/                 k = train steps completed = the weight version the learner publishes next
      model/                  Hugging Face model directory (AutoModelForCausalLM / AutoTokenizer load it)
      training_state.pt       optimizer, LR schedule, loss scaler, ACRL reference, RNG states (learner/trainer.py)
      meta.json               {"step": k, "version": k, "buffer": cursor and counters, "live": {key: value}, ...}

Atomic: everything is written into `.step_<k>.tmp`, fsynced, then renamed to `step_<k>`; a directory named
`step_<k>` is therefore complete, and leftovers of a crash (`.*.tmp`) are ignored and removed by the next save. Old
checkpoints are deleted likewise: renamed to `.step_<k>.del.tmp`, then removed.

The buffer is not copied: its journal (runs/<name>/buffer.journal) already records every lease, admission and
consumption. On resume the buffer replays it and rewinds to the checkpoint's step (buffer/recovery.py `rewind`): groups
consumed after the checkpoint go back to the queue, groups generated with the lost versions are dropped.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.fsutil import fsync_dir, fsync_tree
from common.run_files import CHECKPOINTS, STEP_DIR

META = "meta.json"
TRAINING_STATE = "training_state.pt"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found) if (p / META).is_file()]


def latest(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


class CheckpointError(ValueError):
    """A checkpoint that cannot serve a resume; the message names the file and the fault."""


def latest_whole(run_dir: Path, say: Callable[[str], Any] | None = None) -> Path | None:
    """The newest checkpoint whose files are whole (`damage`), or None; each newer `step_<k>` that is not (a damaged
    file, or no meta.json) is named through `say` with what is wrong, and passed over, never deleted."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    found = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name))), reverse=True)
    for _, path in found:
        problem = damage(path)
        if not problem:
            return path
        if say is not None:
            say(f"checkpoint {path.name} passed over: {problem}")
    return None


def damage(checkpoint_dir: Path) -> str:
    """What makes `checkpoint_dir` unfit to resume from, naming the file, or "" when its meta.json, model config and
    files and training state are whole: headers and zip directories, and every member of the training state
    against its CRC-32 (torch.load checks none: flipped bytes in AdamW's moments loaded silently and
    the next update wrote NaNs into the weights). Safetensors files carry no checksum: their headers and sizes only."""
    from common.model_files import ModelFilesError, check_safetensors_file, check_weight_files

    try:
        read_meta(checkpoint_dir)
    except CheckpointError as err:
        return str(err)
    model = checkpoint_dir / "model"
    lora = (model / "adapter_config.json").is_file()  # LoRA: the adapters (learner/lora.py)
    if not model.is_dir():
        return f"{model} is missing"
    config = model / ("adapter_config.json" if lora else "config.json")
    try:
        if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
            return f"{config} is not a JSON object"
    except FileNotFoundError:
        return f"{config} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{config} cannot be read as JSON ({err})"
    try:
        if lora:
            check_safetensors_file(str(model), "adapter_model.safetensors")
        else:
            check_weight_files(str(model))
    except ModelFilesError as err:
        return str(err).removeprefix("model.path=")
    return _state_damage(checkpoint_dir / TRAINING_STATE)


_STATE_CHECKED: dict[tuple[str, int, int], str] = {}
"""`_state_damage` of a training state file by (path, mtime, size): a resume asks twice (the CLI, then the driver),
and a CRC pass reads the whole file (AdamW's moments: 8 bytes a parameter)."""


def _state_damage(state: Path) -> str:
    try:
        stat = state.stat()
    except FileNotFoundError:
        return f"{state} is missing"
    except OSError as err:
        return f"{state} is not readable ({err})"
    key = (str(state), stat.st_mtime_ns, stat.st_size)
    if key not in _STATE_CHECKED:
        try:
            with zipfile.ZipFile(state) as archive:  # torch.save's format: the directory sits at the end
                if not any(name.endswith("data.pkl") for name in archive.namelist()):
                    problem = f"{state} is not a torch.save archive (no data.pkl)"
                else:
                    bad = archive.testzip()
                    problem = f"{state} is damaged: its member {bad} fails its CRC-32 check" if bad else ""
        except FileNotFoundError:
            problem = f"{state} is missing"
        except (zipfile.BadZipFile, OSError) as err:
            problem = f"{state} is not a whole torch.save archive ({err}: truncated?)"
        _STATE_CHECKED[key] = problem
    return _STATE_CHECKED[key]


def newest_run(base: Path) -> Path | None:
    """The newest run directory of a config whose runs are `base`, `base-2`, `base-3`, ... (`driver.new_run_dir`):
    the one with the highest number that holds a config.json, or None."""
    runs = [(1, base)] if (base / "config.json").is_file() else []
    if base.parent.is_dir():
        for path in base.parent.glob(f"{base.name}-*"):
            suffix = path.name[len(base.name) + 1 :]
            if suffix.isascii() and suffix.isdigit() and (path / "config.json").is_file():
                runs.append((int(suffix), path))
    return max(runs)[1] if runs else None


def finished_steps(run_dir: Path) -> int | None:
    """The steps a run trained if its summary.json says it finished them (`stopped_early` false), else None (no or
    a damaged summary: killed or running; a stop, which saves a checkpoint or was abandoned)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("stopped_early") is not False:
        return None
    steps = summary.get("steps")
    return steps if type(steps) is int else None


def read_meta(checkpoint_dir: Path) -> dict[str, Any]:
    """`checkpoint_dir`'s meta.json; CheckpointError naming it if it is missing, unreadable, or its step is not the
    directory's."""
    path = checkpoint_dir / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (a checkpoint cut short?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON ({err})") from None
    match = STEP_DIR.fullmatch(checkpoint_dir.name)
    step = meta.get("step") if isinstance(meta, dict) else None
    if type(step) is not int or step < 0 or (match is not None and step != int(match.group(1))):
        expected = f", not {match.group(1)} as its directory says" if match else ""
        raise CheckpointError(f"{path}: its step is {step!r}{expected}")
    return meta


def save(run_dir: Path, step: int, write: Callable[[str], Any], meta: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint `step_<step>` with `write(tmp_dir)` (the learner's files) plus meta.json, atomically;
    then delete all but the newest `keep_last` checkpoints. Returns the checkpoint directory."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    target = root / f"step_{step}"
    staging = root / f".step_{step}.tmp"
    staging.mkdir()
    try:
        write(str(staging))
        (staging / META).write_text(json.dumps({"step": step, **meta}, indent=2, default=str))
        fsync_tree(staging)
    except BaseException:  # a full disk: what was written frees its space for the next try (or the resume)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replaced = root / f".step_{step}.old.tmp"
    if replaced.exists():  # left by a crash during an earlier resave: in the way of the rename below
        shutil.rmtree(replaced, ignore_errors=True)
    if target.exists():  # the same step saved again (`down` right after a periodic save): moved aside, not deleted
        target.rename(replaced)  # in place, so that a crash never leaves a half-deleted step_<k> as the latest
    staging.rename(target)
    fsync_dir(root)
    shutil.rmtree(replaced, ignore_errors=True)
    # this one and the newest `keep_last - 1` before it: a newer step_<k>, which only a resume that passed it over
    # (damaged: `latest_whole`) leaves behind, is never deleted and never counts among them (it did, and with
    # keep_last=1 every whole checkpoint was deleted as soon as it was written, the damaged one kept)
    earlier = [path for path in checkpoint_dirs(run_dir) if _step(path) < step]
    kept = {target, *earlier[max(len(earlier) - (keep_last - 1), 0) :]}
    for old in root.iterdir():  # older checkpoints, and a step_<k> a kill left half deleted (no meta.json)
        if STEP_DIR.fullmatch(old.name) and old not in kept and _step(old) < step:
            _delete(old)
    return target


def _step(checkpoint_dir: Path) -> int:
    match = STEP_DIR.fullmatch(checkpoint_dir.name)
    return int(match.group(1)) if match else -1


def _delete(directory: Path) -> None:
    """Renamed out of the `step_<k>` names first (atomic), then deleted: a kill partway through the deletion leaves
    a `.*.tmp`, which the next save removes, never a half-deleted `step_<k>` that no listing shows and none prunes."""
    doomed = directory.with_name(f".{directory.name}.del.tmp")
    try:
        directory.rename(doomed)
    except OSError:
        doomed = directory
    shutil.rmtree(doomed, ignore_errors=True)
