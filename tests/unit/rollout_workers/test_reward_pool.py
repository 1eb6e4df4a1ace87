"""User reward functions in a real reward process (rollout_workers/reward_pool.py): a function that raises, hangs,
kills its process or returns garbage scores 0 and is counted, and the worker's next calls still work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.config import RewardConfig
from common.reward_fns import RewardFnError
from rollout_workers.reward_pool import RewardMetrics, RewardPool, RewardScorer

USER_FILE = """
import os
import time

calls = 0

def every_third_raises(response, answer, row):
    global calls
    calls += 1
    if calls % 3 == 0:
        raise RuntimeError(f"reward bug on call {calls}")
    return 1.0

def sleeps_forever(response, answer, row):
    if response == "hang":
        while True:
            time.sleep(1)
    return 0.5

def dies(response, answer, row):
    if response == "die":
        os._exit(3)
    return 1.0

def with_metrics(response, answer, row):
    return {"score": float(response == answer), "length": len(response), "index": row["index"]}

def garbage(response, answer, row):
    return {"length": 1} if response == "no score" else "1.0"

def pid(response, answer, row):
    return float(os.getpid())

def huge(response, answer, row):
    return 1e308


def matches(response, answer, row):
    return float(response == answer)

def long_response(response, answer, row):
    return float(len(response) > 3)

warmed = 0.0

def reward_warm_up():
    global warmed
    warmed = 1.0

def was_warmed(response, answer, row):
    return warmed

def terminates_a_child(response, answer, row):
    import subprocess
    child = subprocess.Popen(["sleep", "30"])
    child.terminate()
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()
        return 0.0
    return 1.0

def leaves_a_child_and_hangs(response, answer, row):
    import subprocess
    child = subprocess.Popen(["sleep", "300"])
    with open(response, "w") as f:
        f.write(str(child.pid))
    while True:
        time.sleep(1)

def forks(response, answer, row):
    os.fork()  # both return 1.0: only the reward process may answer
    return 1.0

trl_calls = 0

def trl_match(prompts, completions, answer, index, **kwargs):  # TRL's GRPOTrainer reward function signature
    global trl_calls
    trl_calls += 1
    batch = float(len(completions))
    return [{"score": float(c == a), "calls": float(trl_calls), "batch": batch, "prompt": float(p == "q")}
            for p, c, a in zip(prompts, completions, answer)]

def trl_chat(prompts, completions, **kwargs):  # conversational: messages in, messages out
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant") * len(c[0]["content"])
            for p, c in zip(prompts, completions)]

def trl_lengths(completions, completion_ids, **kwargs):  # TRL passes the completions' token ids too
    return [float(len(ids)) for ids in completion_ids]

def trl_maybe(completions, **kwargs):
    return [None if c == "n/a" else 1.0 for c in completions]

def trl_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def trl_raises(completions, **kwargs):
    raise ValueError("judge unreachable")

def trl_hangs(completions, **kwargs):
    while "hang" in completions:
        time.sleep(1)
    return [0.25] * len(completions)
"""


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "user_reward.py"
    path.write_text(USER_FILE, encoding="utf-8")
    return str(path)


@pytest.fixture
def make_pool():
    pools: list[RewardPool] = []

    def make(specs: list[str], timeout_s: float = 5.0) -> RewardPool:
        pools.append(RewardPool(specs, timeout_s))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def _scorer(user_file: str, names: list[str], weights: list[float] | None = None, timeout_s: float = 5.0):
    cfg = RewardConfig(fns=[f"{user_file}:{name}" for name in names], weights=weights or [], timeout_s=timeout_s)
    return RewardScorer(cfg, task_reward=lambda response, answer: 0.0)


def test_a_function_raising_on_every_third_call_scores_zero_is_counted_and_logged_once(user_file):
    scorers = [_scorer(user_file, ["every_third_raises"]) for _ in range(2)]  # two workers, each its own process
    try:
        items = [(f"r{i}", "a", {"index": 100 + i}) for i in range(9)]
        rewards = scorers[0].score(items[:4]) + scorers[0].score(items[4:])  # the count goes on across batches
        scorers[1].score(items[:3])
    finally:
        for scorer in scorers:
            scorer.close()
    assert rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert (scorers[0].errors, scorers[0].timeouts, scorers[0].pool.restarts) == (3, 0, 0)  # the process goes on
    assert "'every_third_raises' failed on row 102" in scorers[0].first_error
    assert "RuntimeError: reward bug on call 3" in scorers[0].first_error and "Traceback" in scorers[0].first_error
    # the driver: the counts of every worker, and the run's first traceback logged once over steps and workers
    logged: list[str] = []
    metrics = RewardMetrics()
    for _ in range(3):
        stats = [
            {"worker": f"w{i}", "reward_errors": s.errors, "reward_timeouts": s.timeouts,
             "reward_first_error": s.first_error, "reward_metrics": s.metric_sums}
            for i, s in enumerate(scorers)
        ]  # fmt: skip
        assert metrics.update(stats, log=logged.append) == {"reward/errors": 4.0, "reward/timeouts": 0.0}
    assert len(logged) == 1 and logged[0].startswith("w0: reward function 'every_third_raises' failed on row 102")
    assert logged[0].count("Traceback") == 1


@pytest.mark.timeout(60)  # a hang guard: without the per-call timeout this test would never end
def test_a_function_that_hangs_times_out_its_process_is_replaced_and_the_next_calls_work(user_file, make_pool):
    pool = make_pool([f"{user_file}:sleeps_forever", f"{user_file}:pid"], timeout_s=0.5)
    first_pid = pool.score([(1, "x", "a", {})])[0].score
    outcomes = pool.score([(0, "ok", "a", {}), (0, "hang", "a", {}), (0, "ok", "a", {}), (1, "x", "a", {})])
    assert [o.score for o in outcomes[:3]] == [0.5, 0.0, 0.5]
    assert outcomes[1].timed_out and "timed out after 0.5 s" in outcomes[1].error
    assert not outcomes[0].timed_out and not outcomes[2].timed_out and outcomes[2].error == ""
    assert pool.restarts == 1 and outcomes[3].score != first_pid  # the calls after the hang ran in a new process
    hung = pool.score([(0, "hang", "a", {}), (0, "hang", "a", {})])
    assert all(o.timed_out for o in hung) and pool.restarts == 3
    assert pool.score([(0, "ok", "a", {})])[0].score == 0.5


def test_timeouts_are_counted_by_the_scorer(user_file):
    scorer = _scorer(user_file, ["sleeps_forever"], timeout_s=0.3)
    try:
        rewards = scorer.score([("hang", "a", {"index": 7}), ("fine", "a", {"index": 8})])
    finally:
        scorer.close()
    assert rewards == [0.0, 0.5] and (scorer.errors, scorer.timeouts) == (0, 1)
    assert "'sleeps_forever' timed out on row 7" in scorer.first_error


def test_a_function_that_kills_its_process_scores_zero_and_the_pool_recovers(user_file, make_pool):
    pool = make_pool([f"{user_file}:dies"])
    outcomes = pool.score([(0, "ok", "a", {}), (0, "die", "a", {}), (0, "ok", "a", {})])
    assert [o.score for o in outcomes] == [1.0, 0.0, 1.0]
    assert "the reward process died (exit code 3)" in outcomes[1].error and not outcomes[1].timed_out
    assert pool.restarts == 1


def test_invalid_results_are_errors(user_file, make_pool):
    pool = make_pool([f"{user_file}:garbage"])
    no_score, text = pool.score([(0, "no score", "a", {}), (0, "text", "a", {})])
    assert no_score.score == 0.0 and "without `score`" in no_score.error
    assert text.score == 0.0 and "returned str, expected a float or a dict" in text.error
    assert pool.restarts == 0


def test_a_dict_result_carries_extra_metrics_logged_as_means(user_file):
    scorer = _scorer(user_file, ["with_metrics"])
    try:
        rewards = scorer.score([("ab", "ab", {"index": 1}), ("abcd", "x", {"index": 3})])
    finally:
        scorer.close()
    assert rewards == [1.0, 0.0]
    assert scorer.metric_sums == {"length": [6.0, 2.0], "index": [4.0, 2.0]}
    stats = {"worker": "w0", "reward_errors": 0, "reward_timeouts": 0, "reward_metrics": scorer.metric_sums}
    metrics = RewardMetrics()
    assert metrics.update([stats]) == {
        "reward/errors": 0.0, "reward/timeouts": 0.0, "reward/length": 3.0, "reward/index": 2.0,
    }  # fmt: skip
    later = {**stats, "reward_errors": 2, "reward_metrics": {"length": [16.0, 3.0], "index": [4.0, 2.0]}}
    assert metrics.update([later], totals={"reward_errors": 5.0, "reward_timeouts": 1.0}) == {
        "reward/errors": 5.0, "reward/timeouts": 1.0, "reward/length": 10.0,  # the interval's mean only
    }  # fmt: skip


def test_weights_combine_the_scores_of_several_functions(user_file):
    scorer = _scorer(user_file, ["matches", "long_response"], weights=[1.0, -0.25])
    try:
        rewards = scorer.score([("26", "26", {"index": 0}), ("2626", "26", {"index": 1}), ("x", "26", {"index": 2})])
    finally:
        scorer.close()
    assert rewards == [1.0, -0.25, 0.0]
    assert scorer.metric_sums == {"matches": [1.0, 3.0], "long_response": [1.0, 3.0]}  # each function's own mean


def test_finite_scores_whose_weighted_sum_is_not_score_zero_and_are_counted(user_file):
    """2 x 1e308 + 1 is inf: the buffer refused every such group (nonfinite_reward) and the run hung on its stall
    watchdog, with reward/errors at 0."""
    scorer = _scorer(user_file, ["huge", "matches"], weights=[2.0, 1.0])
    try:
        rewards = scorer.score([("26", "26", {"index": 0}), ("x", "26", {"index": 1})])
    finally:
        scorer.close()
    assert rewards == [0.0, 0.0] and scorer.errors == 2
    assert "reward function 'huge+matches' failed on row 0" in scorer.first_error
    assert "the weighted sum of the scores [1e+308, 1.0] is inf (reward.weights [2.0, 1.0])" in scorer.first_error


def test_without_reward_functions_the_task_reward_runs_in_process():
    scorer = RewardScorer(RewardConfig(), task_reward=lambda response, answer: float(response == answer))
    assert scorer.pool is None and scorer.score([("1", "1", {}), ("2", "1", {})]) == [1.0, 0.0]


def test_warm_up_runs_at_load_outside_the_timeout(user_file, make_pool):
    assert make_pool([f"{user_file}:was_warmed"]).score([(0, "x", "a", {})])[0].score == 1.0
    # the built-in math reward imports math-verify (about a second cold) at load, not in a first call's timeout
    math = make_pool(["asyncrl:math"], timeout_s=1.0)
    latex = math.score([(0, "so $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}", {}), (0, "\\boxed{26}", "26", {})])
    assert [(o.score, o.timed_out) for o in latex] == [(1.0, False), (1.0, False)]


def test_a_function_that_cannot_load_fails_the_start_naming_it(user_file, tmp_path):
    with pytest.raises(RewardFnError, match=r"^`reward.fns\[1\]` .*has no function 'missing'"):
        RewardPool([f"{user_file}:pid", f"{user_file}:missing"], 1.0)
    with pytest.raises(RewardFnError, match=r"^`reward.fn` .*has no function 'missing'"):  # the key the user set
        RewardPool([f"{user_file}:missing"], 1.0, key="reward.fn")
    crashing = tmp_path / "crashing.py"
    crashing.write_text("raise ImportError('needs a package this machine lacks')\ndef fn(r, a, row):\n    return 1\n")
    with pytest.raises(RewardFnError, match=r"loading .*crashing.py.*needs a package this machine lacks"):
        RewardPool([f"{crashing}:fn"], 1.0)
    two = tmp_path / "two.py"  # every call failed; with dynamic sampling off the run trained on zeros to its "done"
    two.write_text("def two_args(response, answer):\n    return 1.0\n")
    with pytest.raises(RewardFnError, match=r"two.py:two_args' takes \(response, answer\), but it is called as fn"):
        RewardPool([f"{two}:two_args"], 1.0)


def test_the_reward_process_exits_when_the_pool_closes(user_file):
    pool = RewardPool([f"{user_file}:pid"], 5.0)
    child = int(pool.score([(0, "x", "a", {})])[0].score)
    assert child != os.getpid()
    proc = pool._proc
    pool.close()
    assert proc.poll() is not None


def _worker_rollout(fn_spec: str, tmp_path: Path) -> tuple[list, list, dict]:
    """A real rollout worker (built-in model, INT8, groups of 3) scoring two leases with `reward.fn=fn_spec`:
    (its leases, its groups, its stats)."""
    from transformers import AutoModelForCausalLM

    from buffer.client import BufferClient
    from buffer.launcher import start_service, stop_service
    from common.builtin_model import resolve_model_path
    from common.config import load_config, to_dict
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.sections import WorkerSections
    from rollout_workers.worker import RolloutWorker

    cfg = load_config(None, ["train.group_size=3", "staleness.max_lag=50", f"reward.fn={fn_spec}"])
    (tmp_path / "run").mkdir()
    proc, endpoint = start_service(to_dict(cfg), tmp_path / "run")
    model_dir = str(resolve_model_path(cfg.model.path))
    worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "w0", model_dir, endpoint)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    client = BufferClient(endpoint, "w0", timeout_s=5.0)
    try:
        leases, _ = client.lease(2)
        groups = worker.rollout(leases)  # generated on random weights: only the rewards matter here
        return leases, groups, worker.stats()
    finally:
        client.close()
        worker.rewards.close()
        stop_service(proc)


def test_a_rollout_worker_scores_with_the_user_function_and_counts_its_failures(user_file, tmp_path):
    leases, groups, stats = _worker_rollout(f"{user_file}:every_third_raises", tmp_path)
    rewards = [t.reward for _, trajectories in groups for t in trajectories]
    assert rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert stats["reward_errors"] == 2 and stats["reward_timeouts"] == 0 and stats["reward_sum"] == 4.0
    assert f"failed on row {leases[0].index}" in stats["last_error"] == stats["reward_first_error"]


def test_a_rollout_worker_gives_a_trl_function_the_completions_token_ids(user_file, tmp_path):
    _, groups, stats = _worker_rollout(f"{user_file}:trl_lengths", tmp_path)
    trajectories = [t for _, group in groups for t in group]
    assert [t.reward for t in trajectories] == [float(len(t.response_ids)) for t in trajectories]
    assert stats["reward_errors"] == 0


def test_a_reward_function_that_prints_on_every_call_cannot_flood_the_output(tmp_path, capfd, monkeypatch):
    """Its output went straight to the worker's: 10.7 GB of a run's log in 90 s. Now at most OUTPUT_LINES lines a
    window reach it, then one line counting the rest; the process never blocks on the pipe."""
    from rollout_workers import reward_pool

    monkeypatch.setattr(reward_pool, "OUTPUT_LINES", 5)
    loud = tmp_path / "loud.py"
    loud.write_text("def fn(response, answer, row):\n    for i in range(1000):\n        print('line', i)\n"
                    "    return 1\n")  # fmt: skip
    pool = RewardPool([f"{loud}:fn"], 30.0)
    outcomes = pool.score([(0, "x", "a", {}) for _ in range(20)])  # 20,000 lines printed
    assert [o.score for o in outcomes] == [1.0] * 20
    forwarder = pool._output
    pool.close()
    forwarder.join(timeout=30)
    err = capfd.readouterr().err.splitlines()
    assert err[:5] == [f"line {i}" for i in range(5)]
    assert err[5:] == ["reward process: 19995 more lines of its output not shown (at most 5 every 60 s)"]


def test_a_program_a_function_starts_can_be_terminated_even_from_an_actor_that_blocks_sigterm(user_file, make_pool):
    """An actor process blocks SIGTERM (common/actor_host.py) and a process inherits the mask through exec: the
    reward process unblocks it, so `terminate()` of a program the function started works (it did nothing)."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as in a worker actor, before the pool starts
    try:
        pool = make_pool([f"{user_file}:terminates_a_child"], timeout_s=10.0)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    assert pool.score([(0, "x", "a", {})])[0].score == 1.0


def test_a_timed_out_function_s_programs_end_with_its_process(user_file, make_pool, tmp_path: Path):
    """The reward process runs in its own process group: a timeout kills the group, not only the process, so the
    `sleep 300` the function started is not left behind (one orphan per timeout before)."""
    import time

    pool = make_pool([f"{user_file}:leaves_a_child_and_hangs"], timeout_s=1.0)
    pid_file = tmp_path / "child.pid"
    assert pool.score([(0, str(pid_file), "a", {})])[0].timed_out
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"the function's child {child} outlived its timed-out reward process"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_function_that_forks_still_gets_one_answer_per_call(user_file, make_pool):
    """The fork returned into the reward process's loop and answered too: the next calls read its duplicates."""
    pool = make_pool([f"{user_file}:forks"], timeout_s=5.0)
    for _ in range(3):
        outcomes = pool.score([(0, "x", "a", {}), (0, "y", "a", {})])
        assert [(o.score, o.error) for o in outcomes] == [(1.0, ""), (1.0, "")]
    assert pool.restarts == 0


def test_a_trl_reward_function_scores_a_whole_batch_in_one_call_with_the_rows_columns(user_file):
    """TRL's `GRPOTrainer` calls `fn(prompts=[...], completions=[...], <column>=[...])` once per batch; a user brings
    that function unchanged, and a judge or reward model scores the batch at a time."""
    scorer = _scorer(user_file, ["trl_match", "long_response"], weights=[1.0, 0.5])
    try:
        items = [("26", "26", {"index": 0, "prompt": "q"}), ("2626", "26", {"index": 1, "prompt": "q"}),
                 ("7", "8", {"index": 2, "prompt": "other"})]  # fmt: skip
        assert scorer.score(items) == [1.0, 0.5, 0.0]
        assert scorer.score(items[:2]) == [1.0, 0.5]
    finally:
        scorer.close()
    assert scorer.errors == scorer.timeouts == 0
    assert scorer.metric_sums["calls"] == [1.0 * 3 + 2.0 * 2, 5.0]  # one call for each batch: 3 responses, then 2
    assert scorer.metric_sums["batch"] == [3.0 * 3 + 2.0 * 2, 5.0]
    assert scorer.metric_sums["prompt"] == [4.0, 5.0]  # `prompts` is the rows' prompts, in order


def test_a_trl_function_s_none_scores_zero_and_a_wrong_length_or_a_raise_is_each_call_s_error(user_file, make_pool):
    pool = make_pool([f"{user_file}:trl_maybe", f"{user_file}:trl_short", f"{user_file}:trl_raises"])
    assert pool.batched == [True, True, True]
    maybe = pool.score([(0, "a", "", {}), (0, "n/a", "", {}), (0, "b", "", {})])
    assert [(o.score, o.error) for o in maybe] == [(1.0, ""), (0.0, ""), (1.0, "")]  # None: "does not apply"
    short = pool.score([(1, "a", "", {}), (1, "b", "", {})])
    assert all("returned 1 results for a batch of 2 completions" in o.error for o in short)
    raised = pool.score([(2, "a", "", {}), (2, "b", "", {})])
    assert all("ValueError: judge unreachable" in o.error for o in raised) and pool.restarts == 0


@pytest.mark.timeout(60)  # a hang guard
def test_a_trl_function_that_hangs_times_out_once_for_its_batch_and_the_other_function_still_scores(
    user_file, make_pool
):
    pool = make_pool([f"{user_file}:trl_hangs", f"{user_file}:matches"], timeout_s=0.5)
    outcomes = pool.score([(0, "ok", "a", {}), (1, "a", "a", {}), (0, "hang", "a", {}), (1, "b", "a", {})])
    assert outcomes[0].timed_out and outcomes[2].timed_out  # its one call over both responses
    assert [(o.score, o.error) for o in (outcomes[1], outcomes[3])] == [(1.0, ""), (0.0, "")]
    assert pool.restarts == 1  # not once more for the batch's second response
    assert [o.score for o in pool.score([(0, "ok", "a", {}), (0, "ok", "a", {})])] == [0.25, 0.25]


def test_a_trl_function_gets_chat_prompts_and_completions_as_messages_as_trl_passes_them(user_file, make_pool):
    pool = make_pool([f"{user_file}:trl_chat"])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]
    outcomes = pool.score([(0, "4", "4", {"prompt": messages}), (0, "four", "4", {"prompt": messages})])
    assert [(o.score, o.error) for o in outcomes] == [(1.0, ""), (4.0, "")]


def test_a_trl_function_gets_the_token_ids_of_the_completions_the_scorer_is_given(user_file):
    scorer = _scorer(user_file, ["trl_lengths"])
    try:
        assert scorer.score([("ab", "", {"index": 0}), ("c", "", {"index": 1})], [[5, 6, 7], [8]]) == [3.0, 1.0]
        assert scorer.score([("ab", "", {"index": 0})]) == [0.0]  # none given: its call fails, counted
    finally:
        scorer.close()
    assert scorer.errors == 1 and "completion_ids" in scorer.first_error
