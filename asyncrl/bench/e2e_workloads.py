"""The workloads of `asyncrl bench e2e`: what every contender is given, identically.

A `Workload` pins the shape all contenders share: the model directory, the prompts (dumped from our task in stream
order, so TRL reads the very rows asyncrl's buffer hands out), the group size, prompts per step, max new tokens
and the number of steps. Temperature, learning rate and the loss settings come from the asyncrl config
(`configs/dapo_int8.yaml`) and are copied into TRL's `GRPOConfig` by `asyncrl.bench.e2e_trl`.

- `builtin`: the built-in arithmetic task and `builtin:tiny` (overhead-bound: a 0.8M-parameter model, 8 tokens).
- `smol` (opt-in): SmolLM2-135M-Instruct on 345 chat-rendered "What is a ± b?" problems, `data.task=jsonl`, the
  math reward, a held-out split scored twice (issue 26; `asyncrl.bench.e2e_smol`).
- `decode`: a random Llama-family model of about 100M parameters (hidden 1024, 9 layers) with the built-in
  tokenizer, >= 128 new tokens per sample. A random model learns nothing: throughput only. Its tokenizer's EOS is
  an added token (id = the model's vocab size) that the model cannot emit, so every sample runs to max_new_tokens
  on both sides without touching either side's sampling code.

`heldout_greedy_accuracy` is the one shared evaluation: every contender's final model is scored by it (greedy
decoding with Hugging Face `generate`, the task's reward) on the task's held-out problems.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import DataConfig

NEVER_EOS = "</never>"
"""The decode model's EOS token: added to the tokenizer past the model's vocab, so it is never sampled."""


@dataclass(frozen=True, slots=True)
class DecodeShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


FULL_DECODE_SHAPE = DecodeShape(hidden_size=1024, intermediate_size=2816, num_layers=9, num_heads=16, num_kv_heads=4)
"""About 101M parameters (11.3M per layer): the ~100M-parameter row of the issue."""
QUICK_DECODE_SHAPE = DecodeShape(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2)
"""The CI form: the same code paths in seconds."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    """`builtin` or `decode`: the prefix of every metric of this workload."""
    model_dir: str
    steps: int
    """Optimizer steps every contender runs."""
    groups_per_step: int
    """Prompts per step (each sampled `group_size` times)."""
    group_size: int
    max_new_tokens: int
    learns: bool
    """Whether accuracy means anything (False for the random decode model: throughput only)."""
    overrides: tuple[str, ...] = ()
    """asyncrl config overrides of the workload (its task, learning rate, ...): every asyncrl contender applies them,
    and TRL's settings and the shared reward are read from the config with them applied."""
    heldout_path: str = ""
    """A JSONL file of held-out problems (`e2e_smol.write_dataset`) scored by `e2e_smol.heldout_scores`; "" for
    the built-in task's own held-out set (`heldout_greedy_accuracy`)."""

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size


def data_config(eval_size: int = 256, overrides: tuple[str, ...] | list[str] = ()) -> DataConfig:
    """The task section every contender uses: the built-in arithmetic task with the config's defaults, or the
    workload's (`Workload.overrides`: only its `data.` keys are read)."""
    from common.config import load_config

    data = load_config(None, [item for item in overrides if item.startswith("data.")]).data
    data.eval_size = eval_size
    return data


def dump_prompts(workload: Workload, data: DataConfig, path: Path) -> list[dict[str, object]]:
    """Write the training stream's first `steps * groups_per_step` problems (index, prompt, answer) as JSONL."""
    from common.tasks import make_source

    source = make_source(data)
    rows = []
    for index in range(workload.steps * workload.groups_per_step):
        problem = source.train(index)
        rows.append({"index": problem.index, "prompt": problem.prompt, "answer": problem.answer})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def builtin_model_dir() -> str:
    from common.builtin_model import resolve_model_path

    return str(resolve_model_path("builtin:tiny"))


def build_decode_model(target: Path, shape: DecodeShape, max_new_tokens: int) -> str:
    """A random Llama of `shape` with the built-in tokenizer plus an unreachable EOS, saved as a HF directory."""
    from transformers import AutoTokenizer, LlamaConfig

    source_dir = builtin_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    vocab = len(tokenizer)
    tokenizer.add_special_tokens({"eos_token": NEVER_EOS})
    eos_id = tokenizer.convert_tokens_to_ids(NEVER_EOS)
    if eos_id != vocab:
        raise RuntimeError(f"the added EOS got id {eos_id}, expected {vocab} (past the model's vocab)")
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=max(64, 2 * (max_new_tokens + 32)),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    return save_random_llama(config, tokenizer, target)


def save_random_llama(config: Any, tokenizer: Any, target: Path) -> str:
    """A Llama of `config` with N(0, 0.02) matrices and unit norms (seed 0), saved with `tokenizer` at `target`."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # HF's initialisation takes seconds; N(0, 0.02) matrices and unit norms are enough
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator) if param.dim() == 2 else param.fill_(1.0)
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def parameter_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor stored in the directory's safetensors files, by name (nothing is loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def parameter_count(model_dir: str) -> int:
    """Parameters stored in the directory's safetensors files."""
    return sum(math.prod(shape) for shape in parameter_shapes(model_dir).values())


def heldout_greedy_accuracy(model_dir: str, tokenizer_dir: str, data: DataConfig, max_new_tokens: int) -> float:
    """The shared evaluation: greedy accuracy of the model in `model_dir` on the task's held-out problems."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tasks import make_source

    source = make_source(data)
    problems = source.eval_set()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0.0
    with torch.inference_mode():
        for lo in range(0, len(problems), 64):
            chunk = problems[lo : lo + 64]
            enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(source.reward(text, p.answer) for text, p in zip(texts, chunk))
    return correct / max(len(problems), 1)
