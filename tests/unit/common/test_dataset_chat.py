"""Chat templates, prompt-length checks at start and configs/gsm8k_instruct.yaml, on a random-init Llama directory
whose (byte-level) tokenizer has a ChatML template; the rollout worker and the learner's eval encode a templated
prompt to the same token ids."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from common.builtin_model import resolve_model_path
from common.config import DataConfig, load_config, to_dict
from common.tasks import DatasetError, make_source
from common.tasks.chat import (
    CountingTokenizer,
    PromptEncoder,
    check_prompt_lengths,
    check_prompts_fit,
    load_tokenizer,
)
from rollout_workers.embedded.arch import ArchConfig

REPO = Path(__file__).resolve().parents[3]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer random-init Llama with a byte-level tokenizer (every text encodes) and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    tokenizer.chat_template = CHATML
    out = tmp_path_factory.mktemp("chat_model")
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chat_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """verl's shape: a message-list prompt and the answer under reward_model.ground_truth."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": a},
        }
        for a, b in [(1, 2), (30, 4), (5, 60), (7, 8), (12, 13), (40, 2)]
    ]
    path = tmp_path_factory.mktemp("chat_data") / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _data(path: Path, **keys) -> DataConfig:
    return DataConfig(task="dataset", path=str(path), eval_size=4, **keys)


def test_auto_applies_the_template_to_messages_and_to_text_with_a_system_prompt(chat_model_dir, chat_parquet):
    tokenizer = load_tokenizer(str(chat_model_dir))
    data = _data(chat_parquet, answer_key="reward_model.ground_truth")
    source = make_source(data)
    encode = PromptEncoder.for_source(tokenizer, data, source)
    prompt = source.train(0).prompt
    question = json.loads(prompt)[0]["content"]
    assert encode.text(prompt) == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(encode(prompt)) == encode.text(prompt)
    text_data = DataConfig(task="jsonl", path=str(GSM8K), prompt_key="question")
    plain = PromptEncoder(tokenizer, text_data, messages=False)
    assert not plain.templated and plain("How many?") == tokenizer("How many?")["input_ids"]
    with_system = DataConfig(task="jsonl", path=str(GSM8K), prompt_key="question", system_prompt="Be brief.")
    assert PromptEncoder(tokenizer, with_system, messages=False).text("How many?") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"
    )
    off = DataConfig(task="jsonl", path=str(GSM8K), chat_template="false", system_prompt="Be brief.")
    assert PromptEncoder(tokenizer, off, messages=True).text(prompt) == f"Be brief.\n\n{question}"
    forced = PromptEncoder(tokenizer, DataConfig(chat_template="true"), messages=False)
    assert forced.text("2+2") == "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_the_tokenizer_lacks_is_refused() -> None:
    builtin = load_tokenizer(str(resolve_model_path("builtin:tiny")))
    with pytest.raises(DatasetError, match="the prompts are chat messages .* has no chat template"):
        PromptEncoder(builtin, DataConfig(), messages=True)
    with pytest.raises(DatasetError, match="data.chat_template=true but the tokenizer"):
        PromptEncoder(builtin, DataConfig(chat_template="true"), messages=False)
    assert not PromptEncoder(builtin, DataConfig(system_prompt="hi"), messages=False).templated  # auto: no template


def test_the_start_up_counter_reads_the_ids_transformers_gives(chat_model_dir) -> None:
    prompts = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:50]] + ["12+3=", "é ü 中"]
    for model_dir in (str(chat_model_dir), str(resolve_model_path("builtin:tiny"))):
        counter, tokenizer = CountingTokenizer(model_dir), load_tokenizer(model_dir)
        assert CountingTokenizer.usable(model_dir)
        assert [counter(p)["input_ids"] for p in prompts] == [tokenizer(p)["input_ids"] for p in prompts]
        assert bool(counter.chat_template) == bool(tokenizer.chat_template)
        assert set(counter.all_special_ids) >= set(tokenizer.all_special_ids)  # every added special token
        assert counter.unk_token_id == tokenizer.unk_token_id


def test_max_prompt_tokens_drops_long_rows_and_counts_them(chat_model_dir) -> None:
    keys = {"prompt_key": "question", "tokenizer": str(chat_model_dir), "system_prompt": "Be brief."}
    full = make_source(_data(GSM8K, **keys))
    source = make_source(_data(GSM8K, max_prompt_tokens=200, **keys))
    encode = PromptEncoder.for_source(load_tokenizer(str(chat_model_dir)), _data(GSM8K, **keys), source)
    assert source.dropped > 0 and source.epoch_size() == 1319 - source.dropped
    assert all(len(encode(source.train(i).prompt)) <= 200 for i in range(source.epoch_size()))
    assert sum(len(encode(full.train(i).prompt)) > 200 for i in range(1319)) == source.dropped
    assert all(source.row(i)["question"] == source.train(i).prompt for i in range(0, 1319, 7))  # rows stay aligned
    with pytest.raises(DatasetError, match="every one of its 1319 prompts is longer than data.max_prompt_tokens=5"):
        make_source(_data(GSM8K, max_prompt_tokens=5, **keys))


def test_prompts_that_cannot_fit_fail_before_start_with_the_numbers(chat_model_dir, tmp_path: Path) -> None:
    """The issue's case: GSM8K on the built-in model (64-token context) is refused, not left to hang."""
    cfg = load_config(
        str(REPO / "configs" / "dapo_int8.yaml"),
        ["data.task=jsonl", f"data.path={GSM8K}", "data.prompt_key=question", "data.answer_key=answer"],
    )
    builtin = str(resolve_model_path(cfg.model.path))
    source = make_source(cfg.data)
    with pytest.raises(DatasetError) as err:
        check_prompts_fit(source, cfg, builtin, ArchConfig.from_model_dir(builtin).max_positions)
    assert "no prompt fits the model: all 1319 prompts have 74 to 849 tokens" in str(err.value)
    assert "context of 64 tokens (max_position_embeddings) minus rollout.max_new_tokens=8 leaves 56" in str(err.value)

    encode = PromptEncoder(load_tokenizer(str(chat_model_dir)), cfg.data, messages=False)
    warning = check_prompt_lengths(source, encode, max_context=400, max_new_tokens=100)
    share = sum(len(encode(source.train(i).prompt)) > 300 for i in range(1319))
    assert 0 < share < 1319 and warning is not None
    assert f"{share} of all 1319 prompts ({100 * share / 1319:.1f}%) do not fit" in warning

    letters = tmp_path / "letters.jsonl"
    letters.write_text("".join(json.dumps({"prompt": f"add {w} and one", "answer": 1}) + "\n" for w in ("ab", "cd")))
    words = make_source(DataConfig(task="jsonl", path=str(letters), eval_size=1))
    with pytest.raises(DatasetError, match="encodes none of all 2 prompts .* to any token but special or unknown"):
        check_prompt_lengths(words, PromptEncoder(load_tokenizer(builtin), cfg.data, messages=False),
                             max_context=64, max_new_tokens=8)  # fmt: skip


def test_the_gsm8k_instruct_example_loads_gsm8k_and_a_chat_parquet(chat_model_dir, chat_parquet) -> None:
    max_positions = ArchConfig.from_model_dir(chat_model_dir).max_positions
    base = str(REPO / "configs" / "gsm8k_instruct.yaml")
    cfg = load_config(base, [f"model.path={chat_model_dir}", f"data.path={GSM8K}", f"data.tokenizer={chat_model_dir}"])
    assert cfg.data.task == "dataset" and cfg.data.chat_template == "auto" and cfg.data.system_prompt
    source = make_source(cfg.data)
    assert source.dropped > 0 and source.epoch_size() + source.dropped == 1319  # max_prompt_tokens: 512
    note = check_prompts_fit(source, cfg, str(chat_model_dir), max_positions)  # no error: the rest fit 1024 - 512
    assert note == (
        f"{source.dropped} of 1319 rows ({100 * source.dropped / 1319:.1f}%) dropped: longer than "
        "data.max_prompt_tokens=512 tokens"
    )
    encode = PromptEncoder.for_source(load_tokenizer(str(chat_model_dir)), cfg.data, source)
    assert encode.templated and encode.text(source.train(0).prompt).startswith("<|im_start|>system\n")

    keys = ["data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth", f"data.tokenizer={chat_model_dir}"]
    chat = load_config(base, [f"model.path={chat_model_dir}", f"data.path={chat_parquet}", *keys])
    chat_source = make_source(chat.data)
    assert chat_source.messages and chat_source.epoch_size() == 6
    assert check_prompts_fit(chat_source, chat, str(chat_model_dir), max_positions) is None
    assert sorted(chat_source.train(i).answer for i in range(6)) == sorted(["3", "34", "65", "15", "25", "42"])


def test_the_worker_and_the_learner_encode_a_templated_prompt_to_the_same_ids(chat_model_dir, chat_parquet, tmp_path):
    """The real RolloutWorker (with a real buffer) and the learner's `Learner.evaluate` code path."""
    import torch
    from transformers import AutoModelForCausalLM

    from buffer.client import BufferClient
    from buffer.launcher import start_service, stop_service
    from learner.trainer import Learner
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.sections import WorkerSections
    from rollout_workers.worker import RolloutWorker

    overrides = [f"model.path={chat_model_dir}", "data.task=dataset", f"data.path={chat_parquet}",
                 "data.answer_key=reward_model.ground_truth", "data.system_prompt=Add.", "train.group_size=2",
                 "train.groups_per_step=2", "rollout.max_new_tokens=4", "data.eval_size=2"]  # fmt: skip
    cfg = load_config(None, overrides)
    (tmp_path / "run").mkdir()
    proc, endpoint = start_service(to_dict(cfg), tmp_path / "run")
    client = BufferClient(endpoint, "w0", timeout_s=5.0)
    try:
        worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "w0", str(chat_model_dir), endpoint)
        model = AutoModelForCausalLM.from_pretrained(chat_model_dir)
        worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
        leases, _ = client.lease(2)
        groups = worker.rollout(leases)
    finally:
        client.close()
        stop_service(proc)
    worker_ids = {lease.prompt: trajectories[0].prompt_ids.tolist() for lease, trajectories in groups}
    assert len(worker_ids) == 2

    seen: list[list[int]] = []

    def generate(input_ids, attention_mask, **kwargs):  # noqa: ANN001, ANN202  (records the learner's eval input)
        seen.extend(row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask))
        return torch.cat([input_ids, torch.full((len(input_ids), 1), 2)], dim=1)

    model.generate = generate
    learner = type("LearnerStub", (), {})()
    learner.sections = type("Sections", (), {"data": cfg.data})()
    learner.tokenizer, learner.pad_id = load_tokenizer(str(chat_model_dir)), 0
    learner._full_precision_copy = lambda: model
    prompts = list(worker_ids)
    Learner.evaluate(learner, prompts, ["0"] * len(prompts), max_new_tokens=4)
    assert seen == [worker_ids[prompt] for prompt in prompts]
    assert load_tokenizer(str(chat_model_dir)).decode(seen[0]).startswith("<|im_start|>system\nAdd.<|im_end|>\n")
