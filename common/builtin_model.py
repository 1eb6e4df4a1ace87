"""The built-in tiny model (`model.path: builtin:tiny`): a deterministic, cached recipe.

It produces a real Hugging Face model directory (LlamaForCausalLM weights as safetensors, `config.json`, and a
character-level `tokenizer.json`) so that every code path that loads user models loads this one too.

The recipe warms a randomly initialised model up on the built-in arithmetic task to a "perfectible" start
(the FP16 paper's sanity test): it has learned the task's structure but samples the wrong answer often at
temperature 1, so RL has something real to fix. The supervised labels have a fraction `label_noise` of their
answer digits replaced by random digits; the model therefore learns a calibrated but spread-out answer
distribution (its greedy answer is mostly right, its temperature-1 samples solve 20-60% of problems). Only the
verifier's reward tells RL which samples were right.

`builtin:tiny-outliers` (OutlierRecipe) is tiny reparametrized to carry a few outlier activation channels, as real
LLMs do: the same function in fp32, but per-token activation quantization (W8A8 rollout) bites
(docs/algorithms.md, "Outlier channels"). It is built from the cached tiny in seconds.

`builtin:tiny-tool` (common/builtin_tool.py) adds the characters `[]{}` to the vocabulary and is warmed up to call a
calculator, for `data.task=arith_tool` (multi-turn episodes, issue 21).

Built once per recipe version into `<cache>/builtin/<name>-<fingerprint>/`, atomically (a temporary directory
renamed into place), so concurrent runs and tests never see a half-written model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from common.builtin_tool import TOOL_RECIPES, ToolRecipe

ARITH_ALPHABET = "0123456789+-="
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


@dataclass(frozen=True, slots=True)
class TinyRecipe:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 64
    digits: int = 2
    ops: str = "+-"
    warmup_steps: int = 800
    batch_size: int = 128
    lr: float = 3e-3
    label_noise: float = 0.03
    trailing_digit_prob: float = 0.5
    seed: int = 20261121
    data_seed: int = 777
    version: int = 1


RECIPES: dict[str, TinyRecipe] = {
    "tiny": TinyRecipe(),
    # For smoke tests: same architecture family and tokenizer, seconds to build, barely trained.
    "micro": TinyRecipe(hidden_size=32, intermediate_size=64, num_layers=2, warmup_steps=40, batch_size=32),
}


@dataclass(frozen=True, slots=True)
class OutlierRecipe:
    """A built-in model reparametrized to carry outlier activation channels, as real LLMs do (LLM.int8, SmoothQuant).

    For the `channels` hidden channels whose RMSNorm outputs are largest on average (over every decoder layer's
    input_layernorm and post_attention_layernorm, on `calib_prompts` prompts of the task), every layer's two norm
    weights are multiplied by `alpha` on those channels and the matching input columns of the linears they feed
    (q/k/v, gate/up) divided by `alpha`. The model computes the same function (bit for bit in fp32 for a
    power-of-two `alpha`, the default); per-token activation quantization (W8A8) now sees channels `alpha` times
    larger than the rest, whose precision they crush. The defaults, 3 channels x 64, give INT8 rollout the
    mismatch of a real 135M instruct model (docs/probe.md).
    """

    base: str = "tiny"
    channels: int = 3
    alpha: float = 64.0
    calib_prompts: int = 64
    version: int = 1


OUTLIER_RECIPES: dict[str, OutlierRecipe] = {
    "tiny-outliers": OutlierRecipe(),
}


class ModelCacheError(ValueError):
    """A built-in model that cannot be built where the cache is (read-only, full); `os_error` is why."""

    def __init__(self, message: str, os_error: OSError) -> None:
        super().__init__(message)
        self.os_error = os_error


def cache_root(cache_dir: str = "") -> Path:
    """Where built-in models live: `model.cache_dir`, else $ASYNCRL_CACHE, else ~/.cache/asyncrl."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("ASYNCRL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "asyncrl"


def recipe_fingerprint(recipe: TinyRecipe) -> str:
    return hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True).encode()).hexdigest()[:12]


def outlier_fingerprint(recipe: OutlierRecipe) -> str:
    """The variant's own settings and its base model's recipe: a new base is a new variant."""
    payload = {"variant": asdict(recipe), "base": asdict(RECIPES[recipe.base])}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def resolve_model_path(path: str, cache_dir: str = "", log=print) -> Path:
    """A model directory for `model.path`: built (or reused from cache) for `builtin:<name>`, else as given."""
    if not path.startswith("builtin:"):
        return Path(path).expanduser()
    name = path.split(":", 1)[1]
    if name in RECIPES:
        recipe: TinyRecipe | OutlierRecipe | ToolRecipe = RECIPES[name]
        fingerprint = recipe_fingerprint(recipe)
        build = partial(build_tiny, recipe)
    elif name in TOOL_RECIPES:
        from common.builtin_tool import build_tool, tool_fingerprint

        recipe = TOOL_RECIPES[name]
        fingerprint = tool_fingerprint(recipe)
        build = partial(build_tool, recipe)
    elif name in OUTLIER_RECIPES:
        recipe = OUTLIER_RECIPES[name]
        base_dir = resolve_model_path(f"builtin:{recipe.base}", cache_dir, log)
        fingerprint = outlier_fingerprint(recipe)
        build = partial(build_outliers, recipe, base_dir)
    else:
        valid = ", ".join("builtin:" + n for n in (*RECIPES, *OUTLIER_RECIPES, *TOOL_RECIPES))
        raise ValueError(f"unknown built-in model {path!r}; valid: {valid}")
    target = cache_root(cache_dir) / "builtin" / f"{name}-{fingerprint}"
    if _complete(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with build_lock(target):  # concurrent processes (parallel tests, several runs) build it once, the others wait
            if _complete(target):
                return target
            _remove_abandoned_builds(target.parent, name)
            log(f"building {path} into {target} (once; later runs reuse it)")
            return _build_into(target, path, recipe, build, log)
    except OSError as err:  # a read-only or full home: say where it builds and how to build it elsewhere
        raise ModelCacheError(
            f"model.path={path}: cannot build it in {target.parent}: {err.strerror or err}; set model.cache_dir "
            "(or $ASYNCRL_CACHE) to a writable directory",
            err,
        ) from None


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on `target`'s build (a lock file beside it), released when its process ends."""
    import fcntl

    with open(target.with_name(f".{target.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_into(target: Path, path: str, recipe: object, build: Callable[[Path], dict], log: Callable) -> Path:
    """Build into a staging directory beside `target`, then rename it into place (a killed build leaves no target)."""
    started = time.monotonic()
    name = path.split(":", 1)[1]
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        report = build(staging)
        (staging / "asyncrl_recipe.json").write_text(json.dumps({"recipe": asdict(recipe), **report}, indent=2))
        staging.chmod(0o755)  # mkdtemp makes it private: a shared cache must be readable by others
        if target.exists() and not _complete(target):  # a damaged copy (files deleted, a copy cut short)
            shutil.rmtree(target.rename(target.with_name(f".{target.name}.damaged-{os.getpid()}")))
        try:
            staging.rename(target)
        except OSError:
            if not _complete(target):  # lost a race to a complete copy: fine; else raise
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log(f"built {path} in {time.monotonic() - started:.0f} s: {json.dumps(report)}")
    return target


BUILT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "asyncrl_recipe.json")
"""What a usable built-in model directory holds (a build writes them all; the recipe record last)."""


def _complete(model_dir: Path) -> bool:
    """A built-in model directory with every file a build writes (the recipe record is written last)."""
    return all((model_dir / name).is_file() for name in BUILT_FILES)


def _remove_abandoned_builds(parent: Path, name: str, older_than_s: float = 3600.0) -> None:
    """Staging directories of builds killed midway (a build takes minutes: an hour-old one is dead)."""
    for stale in parent.glob(f".{name}-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > older_than_s:
                shutil.rmtree(stale, ignore_errors=True)


def make_tokenizer(alphabet: str = ARITH_ALPHABET):
    """A character-level Hugging Face fast tokenizer over `alphabet` (the arithmetic one by default), BOS prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(alphabet))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )


def _noisy_answer(answer: str, recipe: TinyRecipe, rng: random.Random) -> str:
    """The answer with a few digits replaced and, sometimes, a spurious trailing digit (the habit RL must unlearn)."""
    noisy = "".join(rng.choice("0123456789") if rng.random() < recipe.label_noise else ch for ch in answer)
    if rng.random() < recipe.trailing_digit_prob:
        noisy += rng.choice("0123456789")
    return noisy


def build_tiny(recipe: TinyRecipe, out_dir: Path) -> dict[str, float]:
    """Initialise, warm up and save the tiny model into out_dir; returns a small report."""
    from common.tasks.arith import arith_problem
    from common.warmup import new_model, warm_up

    tokenizer = make_tokenizer()
    model = new_model(recipe, tokenizer)
    rng = random.Random(recipe.seed)
    eos = tokenizer.eos_token_id

    def example(index: int) -> tuple[list[int], list[int]]:
        problem = arith_problem(recipe.data_seed, index, recipe.digits, recipe.ops)
        prompt_ids = tokenizer(problem.prompt)["input_ids"]
        answer = _noisy_answer(problem.answer, recipe, rng)
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
        return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids

    loss = warm_up(model, recipe, tokenizer.pad_token_id, example, ramp_steps=100)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "final_sft_loss": round(loss, 4),
        "warmup_steps": recipe.warmup_steps,
        **warm_start_accuracy(model, tokenizer, recipe),
    }


def warm_start_accuracy(model, tokenizer, recipe: TinyRecipe, n: int = 512) -> dict[str, float]:
    """Accuracy on training-distribution problems, greedy and sampled at temperature 1 (the "perfectible" check)."""
    import torch

    from common.tasks.arith import arith_problem

    problems = [arith_problem(recipe.data_seed + 1, i, recipe.digits, recipe.ops) for i in range(n)]
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, padding_side="left")
    report = {}
    for name, sampling in (("acc_greedy", {"do_sample": False}), ("acc_t1", {"do_sample": True, "top_k": 0})):
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=6, eos_token_id=tokenizer.eos_token_id, **sampling)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        report[name] = sum(t.strip() == p.answer for t, p in zip(texts, problems)) / n
    return report


NORM_FEEDS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
"""Each decoder layer's RMSNorms and the linears their output feeds (as quant_sync.uaq; common cannot import it)."""


def outlier_channels(model, input_ids, attention_mask, count: int) -> list[int]:
    """The `count` hidden channels with the largest RMS of the norm outputs, averaged over every decoder layer's
    two RMSNorms on real tokens: the channels that already carry the most (real LLMs' massive activations sit in
    a few fixed channels of the residual stream, across layers)."""
    import torch

    sums: list = []
    hooks = []
    real = attention_mask.bool()
    for layer in model.model.layers:
        for norm_name in NORM_FEEDS:
            hooks.append(getattr(layer, norm_name).register_forward_hook(
                lambda _m, _i, out: sums.append(out.detach()[real].pow(2).mean(0).sqrt())
            ))  # fmt: skip
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for hook in hooks:
            hook.remove()
    return sorted(int(c) for c in torch.stack(sums).mean(0).topk(count).indices)


def reparametrize_outliers(model, channels: list[int], alpha: float) -> None:
    """In every decoder layer, multiply both RMSNorm weights by alpha on `channels` and divide the input columns of
    the linears they feed by alpha, in place. A power-of-two alpha scales exactly in fp32: the function is unchanged
    bit for bit (products g*x*w are the same numbers); any other alpha changes it by fp32 rounding."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            for norm_name, linear_names in NORM_FEEDS.items():
                getattr(layer, norm_name).weight[channels] *= alpha
                for dotted in linear_names:
                    module = layer
                    for part in dotted.split("."):
                        module = getattr(module, part)
                    module.weight[:, channels] /= alpha


def build_outliers(recipe: OutlierRecipe, base_dir: Path, out_dir: Path) -> dict[str, float | list[int]]:
    """Reparametrize the built-in model in base_dir per `recipe` (OutlierRecipe) and save it into out_dir."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from common.tasks.arith import arith_problem

    if recipe.channels < 1 or recipe.alpha <= 0:
        raise ValueError(f"outlier recipe needs channels >= 1 and alpha > 0, got {recipe.channels}, {recipe.alpha}")
    base = RECIPES[recipe.base]
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    problems = [arith_problem(base.data_seed + 2, i, base.digits, base.ops) for i in range(recipe.calib_prompts)]
    enc = tokenizer([p.prompt + p.answer for p in problems], return_tensors="pt", padding=True)
    channels = outlier_channels(model, enc["input_ids"], enc["attention_mask"], recipe.channels)
    with torch.no_grad():
        before = torch.log_softmax(model(**enc).logits, -1)
        reparametrize_outliers(model, channels, recipe.alpha)
        after = torch.log_softmax(model(**enc).logits, -1)
    real = enc["attention_mask"].bool()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "channels": channels,
        "alpha": recipe.alpha,
        "fp32_max_abs_logp_change": float((after - before)[real].abs().max()),
    }
