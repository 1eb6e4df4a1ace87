"""The rollout worker's fast tokenizer path (`common.tasks.chat.FastTokenizer`, the `tokenizers` library alone):
the same ids and texts as transformers' `AutoTokenizer` on every directory it accepts, `AutoTokenizer` for every
other, and a worker built on the built-in model never imports transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.builtin_model import resolve_model_path
from common.config import DataConfig, load_config
from common.tasks.chat import FastTokenizer, PromptEncoder, load_tokenizer, prompt_encoder

REPO = Path(__file__).resolve().parents[3]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
EDGE_TEXTS = ["12+3=", "", " ", "é ü 中 🤖", "  two  spaces\n\ttab\r\n", "<s>1+1=</s>", "a<|im_start|>b", "x" * 300]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _texts() -> list[str]:
    rows = GSM8K.read_text().splitlines()[:200] if GSM8K.is_file() else []
    questions = [json.loads(line)["question"] for line in rows]
    answers = [json.loads(line)["answer"] for line in rows[:50]]
    return questions + answers + EDGE_TEXTS + [f"{a}+{b}=" for a in range(0, 100, 7) for b in range(0, 100, 13)]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real byte-level BPE (merges trained on arithmetic and GSM8K-like text), special tokens, a BOS-adding
    post-processor: the shape of a Llama / SmolLM tokenizer, saved by transformers as a user's model would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_texts() * 3, trainer=trainer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", extra_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    out = tmp_path_factory.mktemp("bpe_tokenizer")
    tokenizer.save_pretrained(out)
    return out


def _model_dirs(bpe_dir: Path) -> list[str]:
    return [str(resolve_model_path("builtin:tiny")), str(bpe_dir)]


def test_fast_tokenizer_gives_the_ids_and_texts_of_transformers(bpe_dir) -> None:
    texts = _texts()
    for model_dir in _model_dirs(bpe_dir):
        assert FastTokenizer.usable(model_dir), model_dir
        fast, slow = FastTokenizer(model_dir), load_tokenizer(model_dir)
        for text in texts:
            for specials in (True, False):
                expected = slow(text, add_special_tokens=specials)["input_ids"]
                assert fast(text, add_special_tokens=specials)["input_ids"] == expected, (model_dir, text)
        rng = random.Random(0)
        random_ids = [[rng.randrange(len(slow)) for _ in range(rng.randrange(1, 24))] for _ in range(300)]
        encoded = [slow(text)["input_ids"] for text in texts]
        for ids in encoded + random_ids:
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == slow.decode(ids, skip_special_tokens=skip)
        assert fast.unk_token_id == slow.unk_token_id
        assert set(fast.all_special_ids) >= set(slow.all_special_ids)


def test_the_worker_encoder_matches_the_learners(bpe_dir) -> None:
    """`prompt_encoder` (the worker's) and `PromptEncoder` over `AutoTokenizer` (the learner's eval) agree."""
    data = DataConfig(system_prompt="Be brief.", chat_template="false")
    for model_dir in _model_dirs(bpe_dir):
        for cfg in (DataConfig(), data):
            worker = prompt_encoder(model_dir, cfg, messages=False, trust_remote_code=False)
            learner = PromptEncoder(load_tokenizer(model_dir), cfg, messages=False)
            assert isinstance(worker.tokenizer, FastTokenizer)
            assert [worker(text) for text in _texts()] == [learner(text) for text in _texts()]


def _edit_config(model_dir: Path, out: Path, **changes) -> str:
    import shutil

    shutil.copytree(model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize(
    "changes",
    [
        {"add_bos_token": False},  # transformers rewrites the post-processor
        {"add_eos_token": True},
        {"tokenizer_class": "LlamaTokenizer"},  # a model-specific class may rebuild the backend
        {"tokenizer_class": None},
        {"clean_up_tokenization_spaces": True},  # decode differs
        {"split_special_tokens": True},
        {"mask_token": "<mask>"},  # not in the vocabulary: transformers would add it
        {"auto_map": {"AutoTokenizer": ["tok.Tok", None]}},
    ],
)
def test_directories_transformers_would_change_take_the_slow_path(bpe_dir, tmp_path, changes) -> None:
    model_dir = _edit_config(bpe_dir, tmp_path / "tok", **changes)
    assert not FastTokenizer.usable(model_dir)
    encode = prompt_encoder(model_dir, DataConfig(), messages=False, trust_remote_code=False)
    assert not isinstance(encode.tokenizer, FastTokenizer)
    assert encode("1+1=") == load_tokenizer(model_dir)("1+1=")["input_ids"]


def test_a_chat_template_or_missing_files_take_the_slow_path(bpe_dir, tmp_path) -> None:
    templated = _edit_config(bpe_dir, tmp_path / "chat", chat_template=CHATML)
    assert FastTokenizer.usable(templated)  # counts plain text fast, but a template needs transformers
    encode = prompt_encoder(templated, DataConfig(system_prompt="Add."), messages=False, trust_remote_code=False)
    assert encode.templated and not isinstance(encode.tokenizer, FastTokenizer)
    assert encode("1+1=") == load_tokenizer(templated)(encode.text("1+1="), add_special_tokens=False)["input_ids"]
    legacy = _edit_config(bpe_dir, tmp_path / "legacy")
    (Path(legacy) / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert not FastTokenizer.usable(legacy)
    assert not FastTokenizer.usable(str(tmp_path))  # no tokenizer files at all


def test_a_worker_on_the_builtin_model_does_not_import_transformers(bpe_dir) -> None:
    """In a fresh process, as in a Ray actor: the worker's prompt ids are the learner's, without transformers."""
    cfg = load_config(None, [])
    model_dir = str(resolve_model_path(cfg.model.path))
    code = f"""
import json, sys
from common.config import load_config, to_dict
from rollout_workers.sections import WorkerSections
from rollout_workers.worker import RolloutWorker
cfg = load_config(None, [])
worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "w0", {model_dir!r}, "tcp://127.0.0.1:9")
ids = [worker.encode_prompt(worker.source.train(i).prompt) for i in range(64)]
text = worker.tokenizer.decode(ids[0] + [2], skip_special_tokens=True)
print(json.dumps({{"ids": ids, "text": text, "transformers": "transformers" in sys.modules}}))
worker.rewards.close()
worker.engine.close()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["transformers"] is False
    from common.tasks import make_source

    source = make_source(cfg.data)
    learner = PromptEncoder.for_source(load_tokenizer(model_dir), cfg.data, source)
    assert result["ids"] == [learner(source.train(i).prompt) for i in range(64)]
    assert result["text"] == load_tokenizer(model_dir).decode(result["ids"][0] + [2], skip_special_tokens=True)
