"""User reward functions (`reward.fn`, `reward.fns`): what a spec names, how it is loaded, what a call may return.

A spec names one function, called as `fn(response: str, answer: str, row: dict) -> float | dict`:

    path/to/file.py:name      a Python file (relative to the working directory of the run), loaded by path
    package.module:name       an importable module
    asyncrl:arith             built-in: exact match, the `arith` task's reward (common.tasks.rewards:arith_reward)
    asyncrl:math              built-in: the math reward of datasets (common.tasks.rewards:math_reward)

A result is a number (the score) or a dict with a finite `score` and extra numeric metrics (logged as `reward/<key>`
means); anything else, a non-finite number included, is an error and scores 0 (`validate_result`). Several
functions combine as TRL's `reward_funcs` / `reward_weights`: reward = sum_i weights[i] * score_i (`combine`).

A function with a parameter named `completions` is a TRL reward function (`is_batched`), called once for a whole
batch of responses as TRL's `GRPOTrainer` calls it: `fn(prompts=[...], completions=[...], <column>=[...], ...)`, each
keyword a list in the batch's order, one per key of the rows (`answer`, `index` and every dataset field; `prompts` is
their `prompt`; `completion_ids` the responses' token ids where the caller has them; where prompts are chat messages,
each completion is `[{"role": "assistant", "content": text}]`, TRL's conversational format), returning a list of as
many results (a number, a dict as above, or None: TRL's "does not apply", scored 0 without an error). A learned
reward model or a judge served elsewhere scores a batch at a time so.

`check_spec` is the start-up check (config validation): the spec's syntax, the file or module, and that the name is
there. A file is parsed (`ast`), not run, so validating a config runs no user code; a module is imported. The
functions are loaded and called in the rollout worker's reward processes (`serve`, run by
rollout_workers/reward_pool.py), so a function that hangs or crashes cannot stall or kill the worker. A module (or
file) may define `reward_warm_up()`: the reward process calls it once after loading, outside the timeout.

This module is torch-free and cheap to import: it is what a reward process imports before the user's code.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_FNS = {
    "asyncrl:arith": "common.tasks.rewards:arith_reward",
    "asyncrl:math": "common.tasks.rewards:math_reward",
}
"""Built-in reward functions by name -> the module spec that implements them."""
RESERVED_METRICS = ("mean", "errors", "timeouts")
"""`reward/<key>` names the run logs itself; a function's extra metric of that name is logged as `reward/fn_<key>`."""
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

RewardFn = Callable[[str, str, dict[str, Any]], Any]


class RewardFnError(ValueError):
    """A reward spec that is malformed or names a file, module or function that does not exist."""


@dataclass(frozen=True, slots=True)
class RewardSpec:
    spec: str
    """The spec as written (`path/to/file.py:name`, `package.module:name` or `asyncrl:<builtin>`)."""
    location: str
    """The file path or the module name."""
    name: str
    """The function's name in that file or module."""
    is_file: bool


def parse_spec(spec: str, key: str = "reward.fn") -> RewardSpec:
    """Split a spec into file-or-module and function name; raises RewardFnError naming `key` and the spec."""
    resolved = BUILTIN_FNS.get(spec.strip(), spec.strip())
    location, sep, name = resolved.rpartition(":")
    if not sep or not location or not _NAME.fullmatch(name):
        builtins = ", ".join(BUILTIN_FNS)
        raise RewardFnError(
            f"`{key}` {spec!r} is not a reward function spec: write `path/to/file.py:name`, `package.module:name` "
            f"or a built-in ({builtins})"
        )
    if location == "asyncrl":
        raise RewardFnError(f"`{key}` {spec!r}: no built-in reward function {name!r}; valid: {', '.join(BUILTIN_FNS)}")
    is_file = location.endswith(".py") or "/" in location or "\\" in location
    if not is_file and not _MODULE.fullmatch(location):
        raise RewardFnError(f"`{key}` {spec!r}: {location!r} is neither a .py file nor a dotted module name")
    return RewardSpec(spec=spec, location=location, name=name, is_file=is_file)


def absolute_spec(spec: str) -> str:
    """`spec` with a relative file made absolute (against the current directory), so that every process reads the
    same file whatever its own working directory; module specs, built-ins and malformed specs come back unchanged."""
    try:
        parsed = parse_spec(spec)
    except RewardFnError:
        return spec  # the config check names what is wrong with it
    if not parsed.is_file or Path(parsed.location).expanduser().is_absolute():
        return spec
    return f"{Path(parsed.location).expanduser().resolve()}:{parsed.name}"


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (defs, classes, assignments, imports), without running it."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler)):  # conditional ones count: checked at
            names.update(_top_level_names(ast.Module(body=list(ast.iter_child_nodes(node)), type_ignores=[])))  # load
    return names


def check_spec(spec: str, key: str = "reward.fn") -> RewardSpec:
    """The start-up check of one spec: a file must exist and bind `name` at its top level (parsed, not run); a module
    must import and have a callable `name`. Raises RewardFnError naming `key`, the file or module, and the name."""
    parsed = parse_spec(spec, key)
    if parsed.is_file:
        path = Path(parsed.location).expanduser()
        if not path.is_file():
            raise RewardFnError(f"`{key}` {spec!r}: reward file {str(path)!r} does not exist")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError) as err:
            raise RewardFnError(f"`{key}` {spec!r}: reward file {str(path)!r} does not parse: {err}") from err
        names = _top_level_names(tree)
        if parsed.name not in names and "*" not in names:  # a star import may bind it: the load check decides
            raise RewardFnError(f"`{key}` {spec!r}: reward file {str(path)!r} defines no function {parsed.name!r}")
        return parsed
    _import_within(parsed, key, MODULE_CHECK_TIMEOUT_S)
    return parsed


MODULE_CHECK_TIMEOUT_S = 120.0
"""How long the start-up check waits for a module spec to import (in this process: it is the user's code)."""


def _import_within(parsed: RewardSpec, key: str, timeout_s: float) -> None:
    """`load_fn` of a module spec in a daemon thread: whatever its import raises (SystemExit included) becomes a
    RewardFnError naming `key` and the module, and an import that hangs fails after `timeout_s`."""
    outcome: dict[str, BaseException] = {}

    def load() -> None:
        try:
            load_fn(parsed, key)
        except BaseException as err:  # noqa: BLE001 - the user's module: reported, never raised through
            outcome["error"] = err

    thread = threading.Thread(target=load, name="asyncrl-module-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    where = f"`{key}` {parsed.spec!r}: importing module {parsed.location!r}"
    if thread.is_alive():
        raise RewardFnError(f"{where} did not finish within {timeout_s:g} s (does it wait for something at import?)")
    err = outcome.get("error")
    if isinstance(err, RewardFnError):
        raise err
    if err is not None:
        raise RewardFnError(f"{where} failed: {err!r}") from err


def _check_siblings(path: Path, key: str, spec: str) -> None:
    """RewardFnError when a module the file at `path` imports is named like a file beside it but was imported from
    another directory: two reward files that each import their own `utils.py` would both get the first one's (one
    module per name per process)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}  # fmt: skip
    for sibling in path.parent.glob("*.py"):
        if sibling.stem not in imported:
            continue
        module = sys.modules.get(sibling.stem)
        where = getattr(module, "__file__", None)
        if module is None or where is None or sibling == path:
            continue
        if Path(where).resolve().parent != path.parent:
            raise RewardFnError(
                f"`{key}` {spec!r}: {str(path)!r} has a module {sibling.name} beside it, but {sibling.stem!r} is "
                f"already imported from {where!r} (another reward file's, or an installed one): Python keeps one "
                f"module per name, so this file would use that one; rename one of them"
            )


def load_fn(parsed: RewardSpec, key: str = "reward.fn") -> RewardFn:
    """Import the spec's file or module and return its callable; raises RewardFnError naming what is missing.

    A file runs as a module of its own (named after a digest of its resolved path), so it may import modules next
    to it only if its directory is on `sys.path`; its directory is put there, as `python file.py` would."""
    if parsed.is_file:
        path = Path(parsed.location).expanduser().resolve()
        if not path.is_file():
            raise RewardFnError(f"`{key}` {parsed.spec!r}: reward file {str(path)!r} does not exist")
        module_name = "asyncrl_reward_" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise RewardFnError(f"`{key}` {parsed.spec!r}: cannot load {str(path)!r} as Python")
            module = importlib.util.module_from_spec(module_spec)
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException as err:
                del sys.modules[module_name]
                raise RewardFnError(f"`{key}` {parsed.spec!r}: loading {str(path)!r} failed: {err!r}") from err
            _check_siblings(path, key, parsed.spec)
        where = f"reward file {str(path)!r}"
    else:
        try:
            module = importlib.import_module(parsed.location)
        except ImportError as err:
            raise RewardFnError(f"`{key}` {parsed.spec!r}: cannot import module {parsed.location!r}: {err}") from err
        where = f"module {parsed.location!r}"
    fn = getattr(module, parsed.name, None)
    if fn is None:
        raise RewardFnError(f"`{key}` {parsed.spec!r}: {where} has no function {parsed.name!r}")
    if not callable(fn):
        raise RewardFnError(f"`{key}` {parsed.spec!r}: {parsed.name!r} in {where} is not callable")
    return fn


def is_batched(fn: Any) -> bool:
    """Whether `fn` is a TRL reward function (a parameter named `completions`): called once per batch with lists."""
    import inspect

    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _check_call(fn: Any, what: str) -> None:
    """RewardFnError unless `fn(response, answer, row)` binds to its signature: a function of other parameters failed
    every call (each counted as a reward error) and, with dynamic sampling off, the run trained on zeros to its end.
    A TRL function (`is_batched`) takes the rows' columns by name, which only its calls can check."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C callable without one: its calls say
        return
    if is_batched(fn):
        return
    try:
        signature.bind("response", "answer", {})
    except TypeError as err:
        shown = signature.replace(return_annotation=inspect.Signature.empty)
        raise RewardFnError(f"{what} takes {shown}, but it is called as fn(response, answer, row): {err}") from None


def spec_names(specs: Sequence[str]) -> list[str]:
    """A short unique metric name per spec (its function name; `name_2`, ... when two share one)."""
    names: list[str] = []
    for spec in specs:
        base = parse_spec(spec).name
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


# --- results ------------------------------------------------------------------------------------------------------


def plain_result(result: Any) -> float | dict[str, float] | str:
    """A function's return value as plain data that crosses the process boundary: a float, a dict of str -> float,
    or an error message (a str). Run in the reward process; the worker validates again (`validate_result`)."""
    if isinstance(result, bool) or not isinstance(result, (numbers.Real, dict)):
        return f"returned {type(result).__name__}, expected a float or a dict with a finite `score`"
    if isinstance(result, numbers.Real):
        return float(result)
    plain: dict[str, float] = {}
    for metric, value in result.items():
        if not isinstance(metric, str) or isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"returned a dict whose {metric!r} is {type(value).__name__}: keys must be str, values numbers"
        plain[metric] = float(value)
    return plain


def validate_result(result: Any) -> tuple[float, dict[str, float]]:
    """(score, extra metrics) of one call's plain result; raises ValueError saying what is wrong with it."""
    if isinstance(result, float) and not isinstance(result, bool):
        if not math.isfinite(result):
            raise ValueError(f"returned a non-finite score {result}")
        return result, {}
    if not isinstance(result, dict):
        raise ValueError(f"returned {type(result).__name__}, expected a float or a dict with a finite `score`")
    if "score" not in result:
        raise ValueError(f"returned a dict without `score` (keys: {sorted(result)[:8]})")
    metrics: dict[str, float] = {}
    for metric, value in result.items():
        if not isinstance(metric, str) or not isinstance(value, float) or not math.isfinite(value):
            raise ValueError(f"returned a dict whose {metric!r} is {value!r}: values must be finite numbers")
        if metric != "score":
            metrics[f"fn_{metric}" if metric in RESERVED_METRICS else metric] = value
    return result["score"], metrics


@dataclass(slots=True)
class CallOutcome:
    """One function called on one response, as the worker sees it."""

    score: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    """The traceback or what was wrong with the result; "" when the call succeeded."""
    timed_out: bool = False


def combine(outcomes: Sequence[CallOutcome], weights: Sequence[float], names: Sequence[str]) -> tuple[float, dict]:
    """The reward of one response from its functions' outcomes: sum_i weights[i] * score_i (a failed call scores 0),
    and its metrics: each function's extra metrics, plus each function's score under its name when there are
    several."""
    reward = sum(w * o.score for w, o in zip(weights, outcomes, strict=True))
    metrics: dict[str, float] = {}
    for outcome, name in zip(outcomes, names, strict=True):
        metrics.update(outcome.metrics)
        if len(outcomes) > 1:
            metrics[name] = outcome.score
    return reward, metrics


# --- the reward process -------------------------------------------------------------------------------------------


def _exit_with_parent(interval_s: float = 1.0) -> None:
    """End this process when its parent (the worker) is gone, even while a user function hangs: a killed worker
    (`ray kill`, OOM) leaves no reward process behind."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                if os.getpgrp() == os.getpid():  # its own group (reward_pool.py): what its functions started too
                    os.killpg(0, signal.SIGKILL)
                os._exit(0)

    threading.Thread(target=watch, name="asyncrl-reward-watchdog", daemon=True).start()


def warm_up(fns: Sequence[RewardFn]) -> None:
    """Call `reward_warm_up()` of each function's module that defines one, once, at load: imports and caches a
    function needs on its first call happen there, outside the per-call timeout (a cold math-verify import takes
    about a second, which would time out every first call of a fresh process under a short `reward.timeout_s`)."""
    done: set[str] = set()
    for fn in fns:
        module = sys.modules.get(getattr(fn, "__module__", "") or "")
        hook = getattr(module, "reward_warm_up", None)
        if module is not None and callable(hook) and module.__name__ not in done:
            done.add(module.__name__)
            hook()


def serve_fd(fd: int, specs: list[str], key: str = "reward.fns") -> None:
    """The entry point of a reward process (`python -c`): serve on the socket `fd` inherited from the worker.

    Signals first: an actor process blocks SIGTERM and ignores SIGINT (common/actor_host.py), and a process inherits
    both through exec, so a program the user's function starts could not be terminated (`Popen.terminate` did
    nothing). The reward process runs in a session of its own (the worker kills its group on a timeout)."""
    from multiprocessing.connection import Connection

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    serve(Connection(fd), specs, key)


def serve(conn: Any, specs: list[str], key: str = "reward.fns") -> None:
    """A reward process's loop (rollout_workers/reward_pool.py): load the functions, say `ready` (with which are TRL
    functions, `is_batched`) or why not, then for each batch of calls `[(call_id, fn_index, response, answer, row),
    ...]` send one reply per call, in order (a TRL function's calls are one call, at the first of them):
    `(call_id, result)` with a plain result (`plain_result`) or `(call_id, "error", traceback)`. `key`: the config
    key that set `specs` (`reward.fn`, or `reward.fns`, whose i-th is named `reward.fns[i]`), for load errors."""
    _exit_with_parent()
    try:
        keys = [key] if key == "reward.fn" else [f"{key}[{i}]" for i in range(len(specs))]  # as the config set them
        fns = [load_fn(parse_spec(spec), name) for spec, name in zip(specs, keys)]
        for fn, spec, name in zip(fns, specs, keys):
            _check_call(fn, f"`{name}` {spec!r}")
        warm_up(fns)
    except BaseException as err:  # noqa: BLE001 - said to the worker, which fails its start with it
        conn.send(("load_error", str(err)))
        return
    batched = [is_batched(fn) for fn in fns]
    conn.send(("ready", "", batched))
    server_pid = os.getpid()
    while True:
        try:
            calls = conn.recv()
        except (EOFError, OSError):
            return
        if calls is None:
            return
        done: dict[int, tuple] = {}  # replies of the TRL functions' calls, one call of each function per message
        for call_id, fn_index, response, answer, row, *_ in calls:  # then the response's token ids, if sent
            if batched[fn_index] and call_id not in done:
                mine = [call for call in calls if call[1] == fn_index]
                done.update(zip((call[0] for call in mine), _batch_replies(fns[fn_index], mine)))
            if call_id in done:
                reply = done.pop(call_id)
            else:
                try:
                    reply = _reply(call_id, fns[fn_index](response, answer, row))
                except BaseException:  # noqa: BLE001 - a process boundary: the user's function must not end the loop
                    reply = (call_id, "error", traceback.format_exc(limit=-8))
            if os.getpid() != server_pid:  # a fork the function made returned here: it must not answer too
                os._exit(0)
            conn.send(reply)


def _reply(call_id: int, result: Any) -> tuple:
    """One call's reply: `(call_id, plain result)`, or `(call_id, "error", message)`."""
    plain = plain_result(result)
    return (call_id, "error", plain) if isinstance(plain, str) else (call_id, plain)


def _batch_replies(fn: Any, calls: list[tuple]) -> list[tuple]:
    """A TRL function's one call on `calls` (`(call_id, fn_index, response, answer, row[, response ids])`, of that
    function), as one reply per call: its result's items (None scores 0), or the call's error for each of them."""
    rows = [call[4] for call in calls]
    keys = dict.fromkeys(key for row in rows for key in row if key != "prompt")  # every row's, in first-seen order
    columns = {key: [row.get(key) for row in rows] for key in keys}
    columns["answer"] = [call[3] for call in calls]  # the call's own, as a per-response function gets it
    if all(len(call) > 5 for call in calls):
        columns["completion_ids"] = [call[5] for call in calls]  # TRL passes the completions' token ids too
    try:
        prompts = [row.get("prompt") for row in rows]
        completions: list[Any] = [call[2] for call in calls]
        if prompts and isinstance(prompts[0], list):  # chat messages: TRL's conversational format, as it passes them
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        results = fn(prompts=prompts, completions=completions, **columns)
    except BaseException:  # noqa: BLE001 - a process boundary, as above
        message = traceback.format_exc(limit=-8)
        return [(call[0], "error", message) for call in calls]
    if isinstance(results, (str, bytes, dict)) or not hasattr(results, "__len__") or len(results) != len(calls):
        shown = f"{len(results)} results" if hasattr(results, "__len__") else type(results).__name__
        message = f"returned {shown} for a batch of {len(calls)} completions: a TRL reward function returns a list " \
                  "of one result per completion"  # fmt: skip
        return [(call[0], "error", message) for call in calls]
    return [_reply(call[0], 0.0 if result is None else result) for call, result in zip(calls, results)]
