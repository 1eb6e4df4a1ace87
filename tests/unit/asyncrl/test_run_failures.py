"""The one line a failed run ends with (asyncrl/watchdog.py `failure`) and `--resume auto`'s choice of run
(asyncrl/checkpoint.py `newest_run`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl import checkpoint
from asyncrl.supervise import SupervisionError, describe_exit
from asyncrl.watchdog import RunFailed, failure


def _run(path: Path, checkpoint_step: int | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if checkpoint_step is not None:  # whole: a damaged one is passed over (checkpoint.latest_whole)
        step_dir = path / "checkpoints" / f"step_{checkpoint_step}"
        (step_dir / "model").mkdir(parents=True)
        (step_dir / "meta.json").write_text(json.dumps({"step": checkpoint_step}))
        (step_dir / "model" / "config.json").write_text("{}")
        import numpy as np
        import torch
        from safetensors.numpy import save_file

        save_file({"w": np.zeros(2, dtype=np.float32)}, str(step_dir / "model" / "model.safetensors"))
        torch.save({}, step_dir / checkpoint.TRAINING_STATE)
    return path


def test_the_last_line_names_the_process_the_step_and_the_resume_command(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "r", checkpoint_step=20)
    died = SupervisionError(f"the buffer process (pid 7) was {describe_exit(-9)}; it died 4 times, more than ...")
    line = str(failure(died, 39, run_dir))
    assert line == (
        f"the buffer process (pid 7) was killed by SIGKILL; it died 4 times, more than ...; the run stopped at step "
        f"39; resume with `asyncrl up --resume {run_dir}` (from checkpoint step_20)"
    )
    stopped = failure(KeyboardInterrupt("SIGINT again: stopping now, without a checkpoint"), 3, _run(tmp_path / "n"))
    assert stopped.exit_code == 130 and "\n" not in str(stopped)
    assert str(stopped).endswith("at step 3; resume with `asyncrl up --resume " + str(tmp_path / "n") + "` (from the "
                                 "initial model: no checkpoint yet)")  # fmt: skip
    try:
        raise ValueError("bad\nsecond line")
    except ValueError as err:
        bug = failure(err, 5, run_dir)
    assert str(bug).startswith("the driver failed: ValueError: bad;") and "Traceback" in bug.detail
    assert isinstance(bug, RunFailed) and describe_exit(3) == "exit code 3"


def test_newest_run_is_the_highest_numbered_run_of_the_config(tmp_path: Path) -> None:
    base = tmp_path / "runs" / "dapo"
    assert checkpoint.newest_run(base) is None
    _run(base, checkpoint_step=4)
    assert checkpoint.newest_run(base) == base
    _run(tmp_path / "runs" / "dapo-2")
    _run(tmp_path / "runs" / "dapo-10", checkpoint_step=2)
    (tmp_path / "runs" / "dapo-11").mkdir()  # no config.json: not a run
    _run(tmp_path / "runs" / "dapo-x")
    _run(tmp_path / "runs" / "dapox-12")
    newest = checkpoint.newest_run(base)
    assert newest == tmp_path / "runs" / "dapo-10" and checkpoint.latest(newest).name == "step_2"


def test_a_logging_dir_that_cannot_hold_the_run_is_a_startup_error_naming_it(tmp_path: Path) -> None:
    from asyncrl.driver import StartupError, new_run_dir
    from common.config import load_config

    config = load_config(None, [f"logging.dir={tmp_path / 'runs'}", "logging.name=r"])
    first, lock = new_run_dir(config)
    assert first == tmp_path / "runs" / "r" and (first / "config.json").exists()
    second, second_lock = new_run_dir(config)
    assert second == tmp_path / "runs" / "r-2"  # the first holds a run: never mixed with a new one
    lock.release()
    second_lock.release()
    a_file = tmp_path / "rows.jsonl"
    a_file.write_text("{}\n")
    with pytest.raises(StartupError) as caught:
        new_run_dir(load_config(None, [f"logging.dir={a_file}", "logging.name=r"]))
    assert str(caught.value) == (f"logging.dir={a_file}: cannot make the run directory {a_file / 'r'}: Not a directory "
                                 f"({a_file / 'r'})")  # fmt: skip
    assert a_file.read_text() == "{}\n"


def test_the_watchdog_fails_a_run_after_max_nonfinite_steps_skipped_in_a_row() -> None:
    from types import SimpleNamespace

    from asyncrl.watchdog import Watchdog

    pool = SimpleNamespace(totals=lambda: {}, crashes=0)
    events: list[tuple[str, dict]] = []
    watchdog = Watchdog(0.0, 0, lambda name, **fields: events.append((name, fields)), lambda line: None, 3)
    skipped, clean = {"skipped_nonfinite": 1.0, "loss": None}, {"loss": 0.5}
    for step, metrics in enumerate([clean, skipped, skipped, clean, skipped, skipped], start=1):
        watchdog.step_done(step, pool, metrics)  # two in a row at most: an fp16 scale settling, say
    assert watchdog.nonfinite_since == 4 and events == []
    with pytest.raises(RunFailed, match=r"3 train steps in a row \(from step 4\)") as err:
        watchdog.step_done(7, pool, skipped)
    assert "checkpoint step_4 and later ones hold the weights that diverged" in str(err.value)
    assert events == [("diverged", {"first_step": 4, "steps": 3, "reward_sum": 0.0})]
    no_samples = Watchdog(0.0, 0, lambda name, **fields: None, lambda line: None, 2)
    no_samples.step_done(1, pool, {**skipped, "reward/mean": float("nan")})  # a step without new samples
    with pytest.raises(RunFailed, match=r"^the model diverged"):
        no_samples.step_done(2, pool, {**skipped, "reward/mean": float("nan")})
    overflowed = SimpleNamespace(totals=lambda: {"reward_sum": float("inf")}, crashes=0)  # a reward of 1e308, summed
    overflowing = Watchdog(0.0, 0, lambda name, **fields: None, lambda line: None, 2)
    overflowing.step_done(1, overflowed, skipped)
    with pytest.raises(RunFailed, match=r"the rewards do not sum to a finite number \(their sum is inf\)"):
        overflowing.step_done(2, overflowed, skipped)
    fp16 = Watchdog(0.0, 0, lambda name, **fields: None, lambda line: None, 2)  # said "the model diverged"
    fp16.step_done(1, pool, {"skipped_nonfinite": 1.0, "loss": 0.43, "loss_scale": 2.0**63})
    with pytest.raises(RunFailed, match=r"skipped with a finite loss \(0.24\): fp16's scaled gradients overflowed "
                       r"while the loss scale fell to 4.61169e\+18 .*lower `precision.loss_scale_init`"):  # fmt: skip
        fp16.step_done(2, pool, {"skipped_nonfinite": 1.0, "loss": 0.24, "loss_scale": 2.0**62})
    never = Watchdog(0.0, 0, lambda name, **fields: None, lambda line: None, 0)
    for step in range(1, 100):
        never.step_done(step, pool, skipped)  # 0: the run goes on
    assert never.nonfinite_since == 0


def test_resume_refuses_overrides_that_change_the_runs_model_data_quantization_or_group_size(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The checkpoint, the buffer journal and the prompt stream belong to them: a resume with another model.path hung
    after the buffer's rewind, and saved the change into config.json, so every later resume hung too."""
    from asyncrl.cli import main as cli_main
    from common.config import load_config, to_dict

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    saved = json.dumps(to_dict(load_config(None, ["model.path=builtin:tiny", "logging.name=r"])))
    (run_dir / "config.json").write_text(saved)
    for override, shown in [
        ("model.path=builtin:micro", "`model.path` ('builtin:tiny' -> 'builtin:micro')"),
        ("data.seed=7", "`data.seed` (1234 -> 7)"),
        ("quant.scheme=fp8", "`quant.scheme`"),
        ("train.group_size=4", "`train.group_size` (8 -> 4)"),
    ]:
        assert cli_main(["up", "--resume", str(run_dir), override]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"asyncrl: cannot resume {run_dir} with {shown}"), err
        assert "start a new run" in err
    assert (run_dir / "config.json").read_text() == saved  # nothing written


def _stall_report(workers_error: str = "", **since: float) -> dict:
    from asyncrl.watchdog import SINCE_STEP

    counts = {key: 0.0 for key in SINCE_STEP} | since
    workers = [{"worker": "worker-0", "state": "running", "samples": 0, "prompts_skipped": 0, "errors": 1,
                "last_error": workers_error}]  # fmt: skip
    return {"buffer": {"alive": True}, "workers": workers, "since_step": counts, "crashes": 0, "recent_errors": [],
            "learner": "waiting in FetchBatch for step 0"}  # fmt: skip


@pytest.mark.parametrize(
    ("since", "expected"),
    [
        ({"errors": 40.0}, "every rollout failed since step 0 (40 errors, no group pushed; last: ValueError: ids"),
        ({"env_groups_dropped": 6.0}, "every multi-turn episode failed since step 0 (6 groups dropped, none pushed"),
        ({"groups_pushed": 4.0, "samples": 32.0, "reward_errors": 30.0, "reward_timeouts": 2.0},
         "every reward call failed since step 0 (32 of 32 samples; last error: ValueError: ids"),
        ({"groups_pushed": 9.0, "samples": 72.0, "reward_sum": 72.0, "filtered_groups": 9.0},
         "every group pushed since step 0 (9) had equal rewards (mean 1) and was dropped by `algo.filter_groups`"),
        # the environment failed every episode (rewards of 0, equal): it was the reward that got the blame
        ({"groups_pushed": 9.0, "samples": 72.0, "filtered_groups": 9.0, "env_episodes": 72.0, "env_errors": 72.0},
         "every multi-turn episode failed in its environment since step 0 (72 errors and timeouts in 72 episodes"),
    ],
)  # fmt: skip
def test_a_stall_that_nothing_can_end_is_diagnosed(since: dict, expected: str) -> None:
    """Runs that hung silently: a tokenizer the model cannot take (every lease raises), an environment whose
    constructor raises, a reward function that always raises, one that returns a constant under dynamic sampling."""
    from asyncrl.watchdog import Watchdog

    watchdog = Watchdog(0.0, 0, lambda name, **fields: None, lambda line: None)
    assert watchdog.diagnose(_stall_report("ValueError: ids must lie in [0, 16)", **since)).startswith(expected)


def test_a_slow_but_live_run_is_not_diagnosed_and_a_traceback_shows_its_exception() -> None:
    from types import SimpleNamespace

    from asyncrl.watchdog import Watchdog

    watchdog = Watchdog(0.0, 0, lambda name, **fields: None, lambda line: None)
    live = {"groups_pushed": 9.0, "samples": 72.0, "reward_sum": 30.0, "filtered_groups": 8.0, "admitted_groups": 1.0}
    assert watchdog.diagnose(_stall_report("", **live)) == ""  # one group admitted: the step will come
    assert watchdog.diagnose(_stall_report("", errors=2.0, groups_pushed=5.0)) == ""  # errors, but groups go through
    traceback = 'Traceback (most recent call last):\n  File "w.py", line 3, in f\n    g()\nValueError: bad ids\n'
    row = {"worker": "worker-0", "state": "running", "last_error": traceback}
    pool = SimpleNamespace(totals=lambda: {}, crashes=0, recent_errors=[], workers={}, describe=lambda: [row])
    report = watchdog.report(pool, lambda: {}, True, 400.0)
    assert report["workers"][0]["last_error"] == "ValueError: bad ids"
    row["last_error"] = "reward function 'f' failed on row 2 (scored 0): " + traceback
    report = watchdog.report(pool, lambda: {}, True, 400.0)
    assert report["workers"][0]["last_error"] == "reward function 'f' failed on row 2 (scored 0): ValueError: bad ids"


def test_a_run_stalled_on_failing_reward_calls_prints_the_first_traceback() -> None:
    """README: "The run's first failure is logged once with its traceback": logged at a step boundary, so a run
    where every call failed and no step came ended with one line and no traceback."""
    import time as clock
    from types import SimpleNamespace

    from asyncrl.watchdog import Watchdog

    first = "reward function 'bad' failed on row 0 (scored 0): Traceback (most recent call last):\nValueError: boom"
    worker = SimpleNamespace(stats={"reward_first_error": first})
    row = {"worker": "worker-0", "state": "running", "last_error": "ValueError: boom", "samples": 8, "errors": 0}
    totals = {"samples": 8.0, "reward_errors": 8.0, "groups_pushed": 2.0}
    pool = SimpleNamespace(totals=lambda: totals, crashes=0, recent_errors=[], workers={"worker-0": worker},
                           describe=lambda: [row])  # fmt: skip
    watchdog = Watchdog(1.0, 0, lambda name, **fields: None, lambda line: None)
    watchdog.last_step_at = clock.monotonic() - 100.0
    with pytest.raises(RunFailed, match="every reward call failed since step 0") as caught:
        watchdog.check(pool, lambda: {}, True)
    assert caught.value.detail == first


def test_a_dead_evaluation_worker_is_named() -> None:
    from asyncrl.watchdog import actor_death

    message = "The actor died. class_name: EvalWorker, pid=77, exit detail: killed by a signal."
    assert actor_death(message).startswith("the evaluation worker (pid 77) died")


def test_a_run_that_fails_on_a_full_disk_says_so_and_gives_no_traceback(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint's writer failed with torch's `unexpected pos ...` and the metrics with a traceback: the last line
    never said that the disk was full."""
    import errno
    import shutil
    from collections import namedtuple

    run_dir = _run(tmp_path / "r")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, (10 << 30) - (3 << 20), 3 << 20))
    full = failure(OSError(errno.ENOSPC, "No space left on device"), 4, run_dir)
    assert f"at step 4; the disk holding {run_dir} is full (3 MiB free): free space, then resume with" in str(full)
    assert full.detail == ""
    learner = failure(SupervisionError("the learner failed: RuntimeError: unexpected pos 2595328 vs 2595216"), 4,
                      run_dir)  # fmt: skip
    assert "is full (3 MiB free)" in str(learner)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 1 << 30, 9 << 30))
    assert "full" not in str(failure(SupervisionError("the learner failed"), 4, run_dir))


def test_a_checkpoint_that_fails_to_write_leaves_nothing_behind(tmp_path: Path) -> None:
    import errno

    def full(out_dir: str) -> None:
        (Path(out_dir) / "model.bin").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(tmp_path, 3, full, {}, keep_last=2)
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize(
    ("failing", "healthy", "key"),
    [
        (
            {"env_episodes": 16, "env_errors": 15, "env_timeouts": 1, "samples": 16},
            {"env_episodes": 16, "env_errors": 2, "samples": 16},
            "env.fn",
        ),  # fmt: skip
        ({"samples": 32, "reward_errors": 31}, {"samples": 32, "reward_errors": 3}, "reward.fn"),
    ],
)
def test_steps_generated_while_every_environment_or_reward_call_fails_fail_the_run(failing, healthy, key) -> None:
    """An environment whose `step` returned None on every call: both steps trained with loss 0 on rewards of 0
    that nothing computed, and the run exited 0."""
    from types import SimpleNamespace

    from asyncrl.watchdog import FAILING_STEPS, Watchdog

    totals: dict[str, float] = {}

    def add(delta: dict[str, float]) -> None:
        for name, value in delta.items():
            totals[name] = totals.get(name, 0.0) + value

    pool = SimpleNamespace(totals=lambda: dict(totals), crashes=0,
                           describe=lambda: [{"last_error": "TypeError: step returned None"}])  # fmt: skip
    events: list[tuple[str, dict]] = []
    watchdog = Watchdog(0.0, 0, lambda name, **fields: events.append((name, fields)), lambda line: None, 20)
    step = 0
    no_news = {}  # a step so short that the workers' sampled counters did not move: neither ends nor extends it
    for delta in [failing] * (FAILING_STEPS - 1) + [healthy] + [failing, no_news] + [failing] * (FAILING_STEPS - 3):
        add(delta)
        step += 1
        watchdog.step_done(step, pool, {"loss": 0.0})  # a healthy step in between ends the streak
    add(failing)
    with pytest.raises(RunFailed) as err:
        watchdog.step_done(step + 1, pool, {"loss": 0.0})
    assert f"for the {FAILING_STEPS} train steps since step {FAILING_STEPS}" in str(err.value)
    assert f"fix `{key}` (last error: TypeError: step returned None)" in str(err.value)
    assert events[-1] == ("calls_failing", {"key": key, "first_step": FAILING_STEPS, "steps": FAILING_STEPS})


def test_ctrl_c_before_a_command_handles_it_is_one_line_and_exit_130(monkeypatch, capsys) -> None:
    """Ctrl-C while `asyncrl` still imports what a command needs printed a KeyboardInterrupt traceback."""
    from asyncrl import cli

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load", interrupted)  # the first thing `asyncrl config` does
    assert cli.main(["config", "configs/dapo_int8.yaml"]) == 130
    assert capsys.readouterr().err == "asyncrl: interrupted\n"


def test_an_empty_resume_is_named(capsys) -> None:
    """`--resume ""` read the next word as the config (`config file 'train.steps=10' does not exist`)."""
    from asyncrl import cli

    assert cli.main(["up", "--resume", "", "train.steps=10"]) == 2
    assert capsys.readouterr().err == "asyncrl: --resume needs a run directory (or `auto`), got an empty one\n"


def test_every_bench_json_says_its_isa_kernels_and_quick_and_chaos_takes_seeds(tmp_path, capsys) -> None:
    """wire, buffer and learner wrote only name, metrics and ratios: a --quick figure looked like a full one and no
    ISA came with it. `bench chaos --seeds 3` (README's command) was refused as e2e-only."""
    import json

    from asyncrl import cli
    from asyncrl.bench.engine_bench import platform_details

    path = tmp_path / "wire.json"
    assert cli.main(["bench", "wire", "--quick", "--json", str(path)]) == 0
    details = json.loads(path.read_text())["details"]
    assert details["quick"] is True and details["cpu_isa"] == platform_details()["cpu_isa"]
    assert details["kernel_by_scheme"] == platform_details()["kernel_by_scheme"]
    capsys.readouterr()
    assert cli.main(["bench", "chaos", "--seeds", "0"]) == 2
    assert capsys.readouterr().err == "asyncrl: --seeds must be at least 1, got 0\n"
    assert cli.main(["bench", "chaos", "--workloads", "builtin"]) == 2
    assert capsys.readouterr().err == "asyncrl: --workloads: bench e2e only\n"
    assert cli.main(["bench", "wire", "--seeds", "2"]) == 2
    assert "--seeds: bench e2e only (chaos takes --seeds)" in capsys.readouterr().err


def test_overrides_after_an_option_are_overrides(capsys) -> None:
    """docs/precision.md's `asyncrl probe MODEL --schemes none precision.rollout=bf16` ended in argparse's
    "unrecognized arguments": overrides after an option were left over. Anything else left over is still refused."""
    from asyncrl.cli import main

    code = main(["probe", "builtin:micro", "--schemes", "none", "loss.weighting=tsi"])  # reaches the config: refused
    assert code == 2 and "invalid value 'tsi' for `loss.weighting`" in capsys.readouterr().err
    assert main(["up", "train.steps=3"]) == 2  # said "config file 'train.steps=3' does not exist"
    assert "up needs a CONFIG file before its overrides, e.g. `asyncrl up configs/dapo_int8.yaml train.steps=3`" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as caught:
        main(["bench", "learner", "--rows", "smol"])  # not an override: refused as before
    assert caught.value.code == 2 and "unrecognized arguments: --rows smol" in capsys.readouterr().err
