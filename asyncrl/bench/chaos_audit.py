"""The checks of `asyncrl bench chaos` on a finished run: its journal, metrics and summary against the guarantees.

`audit(run_dir, steps, groups_per_step, max_lag)` returns a `RunAudit`:

- `completed`: every train step 0 .. steps-1 logged and the summary says `steps` (the process exit is checked by
  the caller);
- `groups_double_trained`: a group consumed again without a rewind or requeue between (trained twice), plus
  trajectories (uids) of the finally trained groups that repeat another's; and a step whose final batch does not
  hold exactly `groups_per_step` groups counts its extra groups;
- `groups_lost`: groups the journal shows committed and still pending (neither trained, nor dropped as stale or
  filtered, nor dropped by a rewind) that the live buffer did not hold at the end (`queued_groups` of the final
  buffer stats); plus prompt indices the journal shows leased and never resolved that the final buffer neither
  leased nor returned to its pool; plus the `rewind_lost_groups` of the learner restarts (consume records a
  compaction removed);
- `staleness_ok`: `staleness/max <= staleness.max_lag` on every logged step (redone ones included);
- `groups_replayed` (queued groups a restarted buffer rebuilt from its journal, summed over `buffer_restarted`) and
  `groups_rewound` (trained groups a learner restart returned to the queue, summed over `learner_restarted`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.bench.chaos_faults import records, step_records


@dataclass(slots=True)
class RunAudit:
    completed: bool
    steps_logged: int
    groups_trained: int
    groups_double_trained: int
    groups_lost: int
    staleness_ok: bool
    staleness_max: float
    groups_replayed: int
    groups_rewound: int
    compacted: bool
    """The journal was compacted (its index-level check is then skipped)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _journal_view(journal: Path) -> dict[str, Any]:
    from buffer.journal import read_records
    from buffer.state import group_index
    from common import wire

    consumed: dict[str, int] = {}  # group -> the step it is finally trained at
    double = 0
    admitted: dict[str, list[str]] = {}  # group -> its trajectories' uids
    dropped: set[str] = set()
    leased: set[int] = set()
    resolved: set[int] = set()
    compacted = False
    for record in read_records(journal):
        kind, groups = record.get("k"), record.get("g", [])
        if kind == "state":
            compacted = True
        elif kind == "lease":
            leased.update(record["i"])
            resolved.update(record.get("x", []))  # skipped: resolved by the cursor
        elif kind == "admit":
            push = wire.decode(record["m"])
            admitted[push.group] = [t.uid for t in push.trajectories]
            groups = [push.group]
        elif kind == "done":
            dropped.update(groups)
        elif kind == "consume":
            for group in groups:
                double += group in consumed
                consumed[group] = record["s"]
        elif kind in ("requeue", "rewind"):
            for group in groups:
                consumed.pop(group, None)
            dropped.update(record.get("d", []))
        if kind in ("admit", "done", "consume"):
            resolved.update(index for index in map(group_index, groups) if index is not None)
    pending = [g for g in admitted if g not in consumed and g not in dropped]
    return {"consumed": consumed, "double": double, "admitted": admitted, "pending": len(pending),
            "unresolved": len(leased - resolved), "compacted": compacted}  # fmt: skip


def audit(run_dir: Path, steps: int, groups_per_step: int, max_lag: int) -> RunAudit:
    rows = records(run_dir)
    logged = step_records(rows)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    final_steps = sorted({int(r["step"]) for r in logged})
    completed = final_steps == list(range(steps)) and summary.get("steps") == steps
    view = _journal_view(run_dir / "buffer.journal")
    consumed: dict[str, int] = view["consumed"]
    per_step = Counter(consumed.values())
    extra = sum(max(0, n - groups_per_step) for n in per_step.values())
    uids = Counter(uid for group in consumed for uid in view["admitted"].get(group, []))
    repeated_uids = sum(n - 1 for n in uids.values() if n > 1)
    buffer = summary.get("buffer", {})
    lost_pending = max(0, view["pending"] - int(buffer.get("queued_groups", view["pending"])))
    holding = int(buffer.get("leased_groups", 0)) + int(buffer.get("returned_groups", 0))
    lost_leases = 0 if view["compacted"] or not buffer else max(0, view["unresolved"] - holding)
    restarts = [r for r in rows if r.get("event") == "learner_restarted"]
    lost_rewind = sum(int(r.get("rewind_lost_groups", 0)) for r in restarts)
    staleness = [float(r.get("staleness/max", 0.0)) for r in logged]
    return RunAudit(
        completed=completed, steps_logged=len(logged), groups_trained=len(consumed),
        groups_double_trained=view["double"] + extra + repeated_uids,
        groups_lost=lost_pending + lost_leases + lost_rewind,
        staleness_ok=all(s <= max_lag for s in staleness), staleness_max=max(staleness, default=0.0),
        groups_replayed=sum(int(r.get("replayed_groups", 0)) for r in rows if r.get("event") == "buffer_restarted"),
        groups_rewound=sum(int(r.get("rewound_groups", 0)) for r in restarts), compacted=view["compacted"],
    )  # fmt: skip
