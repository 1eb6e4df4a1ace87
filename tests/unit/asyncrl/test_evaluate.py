"""Held-out evaluation metrics (asyncrl/evaluate.py) and their figure in `asyncrl plot`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.evaluate import sample_metrics
from asyncrl.plot import plot_runs, read_evals, read_steps


def test_mean_and_pass_at_k_from_the_draws_of_each_prompt():
    correct = [[True, False, False], [False, False, False], [True, True, True], [False, True, False]]
    rewards = [[1.0 if c else 0.25 for c in row] for row in correct]
    metrics = sample_metrics(correct, rewards)
    assert metrics["eval/mean@3"] == pytest.approx((1 / 3 + 0 + 1 + 1 / 3) / 4)
    assert metrics["eval/pass@3"] == 0.75
    assert metrics["eval/reward_mean@3"] == pytest.approx((5 * 1.0 + 7 * 0.25) / 12)
    assert sample_metrics([], []) == {}
    with pytest.raises(ValueError, match="same number of draws"):
        sample_metrics([[True], [True, False]], [[1.0], [1.0, 0.0]])


def test_eval_events_are_drawn_at_the_step_record_they_followed(tmp_path: Path):
    """A step record's `step` counts from 0, an eval's `after_steps` counts steps done: the eval after 2 steps
    scored the weights of step record 1 (it was drawn at 2, beside the next step's figures)."""
    rows = [{"step": s, "loss": 1.0 / (s + 1), "acc/mean": 0.1 * s} for s in range(4)]
    rows.insert(2, {"event": "eval", "after_steps": 2, "problems": 8, "eval/acc_greedy": 0.25, "eval/pass@4": 0.5})
    rows.append({"event": "eval", "after_steps": 4, "problems": 8, "eval/acc_greedy": 0.5, "eval/pass@4": 0.75})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["eval/pass@4"]) for r in read_evals(run)] == [(1, 0.5), (3, 0.75)]
    assert [r["step"] for r in read_steps(run)] == [0, 1, 2, 3]  # eval events are no steps
    written = {p.name for p in plot_runs([str(run)], str(tmp_path / "plots"))}
    assert "eval.png" in written and "reward_accuracy.png" in written


def test_a_single_eval_is_drawn_as_a_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """With `train.eval_every=0` (the default) a run has one eval, at the end: drawn as a bare line, eval.png was an
    empty frame."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    drawn: list[tuple[int, object]] = []
    real = Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda ax, *a, **kw: drawn.append((len(a[0]), kw.get("marker"))) or real(ax, *a, **kw)
    )
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 1.0} for s in range(40)] + [
        {"event": "eval", "after_steps": 40, "eval/acc_greedy": 0.9}
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_runs([str(run)], str(tmp_path / "plots"))
    assert (1, "o") in drawn and (40, None) in drawn  # the eval's one point marked; a 40-step curve as a line
