"""Built-in task `arith`: procedurally generated addition/subtraction problems with an exact-match reward.

Problem `i` of the training stream is a pure function of (seed, digits, ops, i): its random generator is seeded
from a blake2b digest of those values (never Python's `hash()`, which is salted per process), so every process
and every resumed run sees the same problem `i`. Each operand draws its number of digits uniformly in 1..digits,
then its value uniformly among numbers with that many digits (0-9 for one digit), so carries and borrows happen
naturally. Subtraction swaps the operands when needed so answers are non-negative digit strings.

Prompts are exactly `f"{a}{op}{b}="` (e.g. `347+58=`, answer `405`): only the characters `0123456789+-=` occur,
which the built-in char-level tokenizer relies on.

Held-out problems: a fixed 1/16 of all possible prompts (chosen by a digest of the prompt text, independent of the
seed) is reserved for evaluation. Training streams of every seed skip them, including the warm-up examples drawn
with `arith_problem` from another seed; the eval set draws only from them. When the problem space is so small that
this slice is empty (e.g. digits=1, ops="-"), a draw gives up after `_MAX_TRIES` and eval may overlap training.
"""

from __future__ import annotations

import hashlib
import random

from common.tasks import Problem
from common.tasks.rewards import exact_match_reward

_HELDOUT_MODULUS = 16
_MAX_TRIES = 1024


def _rng(*parts: object) -> random.Random:
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def is_heldout(prompt: str) -> bool:
    """Whether `prompt` belongs to the evaluation slice of the arithmetic problem space (same for every seed)."""
    digest = hashlib.blake2b(b"asyncrl-arith-heldout/" + prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _HELDOUT_MODULUS == 0


def _check(digits: int, ops: str) -> None:
    if digits < 1:
        raise ValueError(f"`data.digits` must be at least 1, got {digits}")
    if not ops or set(ops) - {"+", "-"}:
        raise ValueError(f"`data.ops` must be made of '+' and '-', got {ops!r}")


def _number(rng: random.Random, digits: int) -> int:
    width = rng.randint(1, digits)
    return rng.randint(0, 9) if width == 1 else rng.randint(10 ** (width - 1), 10**width - 1)


def _draw(rng: random.Random, digits: int, ops: str, heldout: bool) -> tuple[str, str]:
    for _ in range(_MAX_TRIES):
        a, b, op = _number(rng, digits), _number(rng, digits), rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        if is_heldout(prompt) == heldout:
            break
    return prompt, str(a + b if op == "+" else a - b)


def arith_problem(seed: int, index: int, digits: int, ops: str) -> Problem:
    """Training problem `index` of the arithmetic stream `seed` (never a held-out prompt, see the module doc)."""
    _check(digits, ops)
    prompt, answer = _draw(_rng("arith-train", seed, digits, ops, index), digits, ops, heldout=False)
    return Problem(index=index, prompt=prompt, answer=answer)


def arith_eval_problem(seed: int, index: int, digits: int, ops: str) -> Problem:
    """Problem `index` of the held-out evaluation stream `seed`."""
    _check(digits, ops)
    prompt, answer = _draw(_rng("arith-eval", seed, digits, ops, index), digits, ops, heldout=True)
    return Problem(index=index, prompt=prompt, answer=answer)


class ArithSource:
    """The `arith` prompt source: an infinite training stream, a fixed eval set, exact-match reward."""

    def __init__(self, *, seed: int, digits: int, ops: str, eval_size: int) -> None:
        _check(digits, ops)
        self.seed, self.digits, self.ops, self.eval_size = seed, digits, ops, eval_size
        self._eval: list[Problem] | None = None

    def train(self, index: int) -> Problem:
        return arith_problem(self.seed, index, self.digits, self.ops)

    def epoch_size(self) -> int | None:
        return None

    def eval_set(self) -> list[Problem]:
        if self._eval is None:
            self._eval = [arith_eval_problem(self.seed, i, self.digits, self.ops) for i in range(self.eval_size)]
        return list(self._eval)

    def reward(self, response_text: str, answer: str) -> float:
        return exact_match_reward(response_text, answer)
