"""The built-in tool-using model (`model.path: builtin:tiny-tool`), for `data.task=arith_tool` (issue 21 item 4).

Its character vocabulary is the arithmetic alphabet plus `[]{}`: the calculator syntax of the `arith_tool`
environment's `brackets` syntax (common/tasks/arith_tool.py). A turn that ends with `[a+b]` calls the calculator;
the environment answers `{c}` (observation tokens, loss mask 0) and the model's next turn is its final answer:

    12345+678=[12345+678]{13023}13023</s>       (tool call, then the result copied)
    12345+678=13023</s>                          (answered "in its head")

The warm-up (a fresh model, like builtin:tiny, on 1..`digits`-digit sums it cannot do in its head) teaches both
habits: a share `tool_share` of its examples call the tool and copy the result, the others answer directly (the
true answer, which the model cannot compute at this size, so it learns a guess). The start is "perfectible": the
model calls the tool on about `tool_share` of problems at temperature 1, mostly right when it does and mostly wrong
when it does not, so RL has a real habit to strengthen (call the tool, copy its result). The calculator's result
tokens are context in the warm-up as in RL (no loss on them).

Built and cached like the other built-in models (common/builtin_model.py `resolve_model_path`); a build takes about
two minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

TOOL_ALPHABET = "[]{}"
"""Characters the tool variant adds to the arithmetic alphabet (ids after the base vocabulary's)."""


@dataclass(frozen=True, slots=True)
class ToolRecipe:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 64
    digits: int = 5
    ops: str = "+"
    tool_share: float = 0.3
    """Share of warm-up examples that call the tool and copy its result (the rest answer directly)."""
    warmup_steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 20261124
    data_seed: int = 778
    version: int = 1


TOOL_RECIPES: dict[str, ToolRecipe] = {
    "tiny-tool": ToolRecipe(),
    # for tests: seconds to build; it learns the syntax less well than tiny-tool
    "micro-tool": ToolRecipe(hidden_size=64, intermediate_size=192, num_layers=2, warmup_steps=250),
}


def tool_fingerprint(recipe: ToolRecipe) -> str:
    payload = {"tool": asdict(recipe), "alphabet": TOOL_ALPHABET}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def calc_text(prompt: str) -> str:
    """The calculator call of an arithmetic prompt `a+b=`: `[a+b]`."""
    return f"[{prompt.rstrip('=')}]"


def _example(tokenizer, prompt: str, answer: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100: no loss) of one warm-up example."""
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    row = tokenizer(prompt)["input_ids"]
    labels = [-100] * len(row)
    if use_tool:
        call, result = ids(calc_text(prompt)), ids("{" + answer + "}")
        row, labels = row + call + result, labels + call + [-100] * len(result)
    final = ids(answer) + [eos]
    return row + final, labels + final


def build_tool(recipe: ToolRecipe, out_dir: Path) -> dict[str, float]:
    """Initialise, warm up and save the tool variant into out_dir; returns a small report."""
    from common.builtin_model import ARITH_ALPHABET, make_tokenizer
    from common.tasks.arith import arith_problem
    from common.warmup import new_model, warm_up

    tokenizer = make_tokenizer(ARITH_ALPHABET + TOOL_ALPHABET)
    model = new_model(recipe, tokenizer)
    rng = random.Random(recipe.seed)

    def example(index: int) -> tuple[list[int], list[int]]:
        problem = arith_problem(recipe.data_seed, index, recipe.digits, recipe.ops)
        return _example(tokenizer, problem.prompt, problem.answer, rng.random() < recipe.tool_share)

    loss = warm_up(model, recipe, tokenizer.pad_token_id, example, ramp_steps=50)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "final_sft_loss": round(loss, 4),
        "warmup_steps": recipe.warmup_steps,
        **tool_warm_start(model, tokenizer, recipe),
    }


def tool_warm_start(model, tokenizer, recipe: ToolRecipe, n: int = 256) -> dict[str, float]:
    """At temperature 1 on held-out-seed problems: the share of episodes that call the tool, the accuracy of those
    that do and of those that do not, and the overall accuracy (a two-turn episode with an exact calculator)."""
    import torch

    from common.tasks.arith import arith_problem
    from common.tasks.arith_tool import SYNTAXES, CalculatorEnv

    problems = [arith_problem(recipe.data_seed + 1, i, recipe.digits, recipe.ops) for i in range(n)]
    close_id = tokenizer.convert_tokens_to_ids(SYNTAXES["brackets"][1])
    eos = tokenizer.eos_token_id

    def sample(texts: list[str], max_new: int) -> list[str]:
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, top_k=0, eos_token_id=[eos, close_id])
        return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)

    torch.manual_seed(0)
    envs = [CalculatorEnv(syntax="brackets") for _ in problems]
    prompts = [env.reset({"prompt": p.prompt, "answer": p.answer}) for env, p in zip(envs, problems)]
    first = sample(prompts, 16)
    steps = [env.step(text) for env, text in zip(envs, first)]
    called = [i for i, s in enumerate(steps) if not s.done]
    rewards = [s.reward for s in steps]
    if called:
        second = sample([prompts[i] + first[i] + steps[i].observation for i in called], 10)
        for i, text in zip(called, second):
            rewards[i] = envs[i].step(text).reward
    direct = [i for i in range(n) if i not in set(called)]
    return {
        "tool_share_t1": len(called) / n,
        "acc_t1": sum(rewards) / n,
        "acc_t1_with_tool": sum(rewards[i] for i in called) / max(len(called), 1),
        "acc_t1_direct": sum(rewards[i] for i in direct) / max(len(direct), 1),
    }
