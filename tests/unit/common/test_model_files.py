"""The start-up check of a model directory's files (`common.model_files`): copies of the built-in micro model with
their weights damaged, their shards missing or another model's tokenizer are refused with one line naming the
directory, the file and the fault; intact models (built-in, sharded, `pytorch_model.bin`, the decode benchmark's
model with its EOS past the vocabulary) are accepted, and the loader the learner uses loads the ones accepted."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from common.builtin_model import resolve_model_path
from common.model_files import ModelFilesError, check_model_files, check_tokenizer_fits, check_weight_files


def _copy(name: str, target: Path) -> Path:
    shutil.copytree(resolve_model_path(f"builtin:{name}"), target)
    return target


@pytest.fixture
def micro(tmp_path: Path) -> Path:
    """A private copy of the built-in micro model (a Llama with vocab_size 16 and its character tokenizer)."""
    return _copy("micro", tmp_path / "micro")


def _refusal(model_dir: Path, **kwargs) -> str:
    with pytest.raises(ModelFilesError) as caught:
        check_model_files(str(model_dir), **kwargs)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model.path={model_dir}: ")
    return message


def _shard(model_dir: Path) -> dict[str, str]:
    """Split model.safetensors into two shards with an index, as `save_pretrained(max_shard_size=...)` writes them."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for number, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        shard = f"model-{number:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(model_dir / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (model_dir / "model.safetensors").unlink()
    total = sum(array.nbytes for array in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def _loads_with_the_learners_loader(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert model.config.vocab_size == 16


@pytest.mark.parametrize("name", ["micro", "tiny"])
def test_the_builtin_models_are_accepted(name: str) -> None:
    check_model_files(str(resolve_model_path(f"builtin:{name}")))


def test_a_decode_bench_model_whose_eos_lies_past_the_vocab_is_accepted(tmp_path: Path) -> None:
    from asyncrl.bench.e2e_workloads import NEVER_EOS, QUICK_DECODE_SHAPE, build_decode_model

    model_dir = Path(build_decode_model(tmp_path / "decode", QUICK_DECODE_SHAPE, max_new_tokens=16))
    config = json.loads((model_dir / "config.json").read_text())
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    assert {"content": NEVER_EOS, "id": config["vocab_size"]}.items() <= added[-1].items()  # the case under test
    assert config["eos_token_id"] == config["vocab_size"]
    check_model_files(str(model_dir))


def test_a_truncated_safetensors_file_is_refused(micro: Path) -> None:
    weights = micro / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    message = _refusal(micro)
    assert "model.safetensors is truncated: its header describes" in message


def test_a_safetensors_file_cut_inside_its_header_is_refused(micro: Path) -> None:
    os.truncate(micro / "model.safetensors", 100)
    assert "model.safetensors is not a safetensors file (its header is incomplete: truncated?" in _refusal(micro)


@pytest.mark.parametrize("size", [0, 5])
def test_an_empty_or_tiny_safetensors_file_is_refused(micro: Path, size: int) -> None:
    os.truncate(micro / "model.safetensors", size)
    assert f"model.safetensors is not a safetensors file ({size} bytes: empty or truncated?)" in _refusal(micro)


def test_a_safetensors_file_of_random_bytes_is_refused(micro: Path) -> None:
    weights = micro / "model.safetensors"
    weights.write_bytes(os.urandom(weights.stat().st_size))
    assert "model.safetensors is not a safetensors file (no JSON header at its start" in _refusal(micro)


def test_a_safetensors_file_with_bytes_after_its_data_is_refused(micro: Path) -> None:
    with (micro / "model.safetensors").open("ab") as handle:
        handle.write(b"\0" * 7)
    assert "model.safetensors is not a whole safetensors file: 7 bytes follow" in _refusal(micro)


def test_a_directory_without_weights_is_refused(micro: Path) -> None:
    (micro / "model.safetensors").unlink()
    message = _refusal(micro)
    assert "no weights: none of model.safetensors, model.safetensors.index.json, pytorch_model.bin" in message


def test_a_sharded_model_is_accepted_and_loads(micro: Path) -> None:
    _shard(micro)
    check_model_files(str(micro))
    _loads_with_the_learners_loader(micro)


def test_a_sharded_model_missing_a_shard_is_refused(micro: Path) -> None:
    _shard(micro)
    (micro / "model-00002-of-00002.safetensors").unlink()
    message = _refusal(micro)
    assert message.endswith(
        "model-00002-of-00002.safetensors: 1 of the 2 shards model.safetensors.index.json names is missing"
    )


def test_a_truncated_shard_is_refused(micro: Path) -> None:
    _shard(micro)
    shard = micro / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    assert "model-00001-of-00002.safetensors is truncated" in _refusal(micro)


def test_a_shard_without_the_tensors_its_index_assigns_to_it_is_refused(micro: Path) -> None:
    _shard(micro)
    first, second = micro / "model-00001-of-00002.safetensors", micro / "model-00002-of-00002.safetensors"
    shutil.copyfile(first, second)  # the same shard twice: the second half of the tensors is nowhere
    assert re.search(r"model-00002-of-00002\.safetensors lacks \d+ of the tensors", _refusal(micro))


def test_an_index_that_is_not_json_is_refused(micro: Path) -> None:
    _shard(micro)
    (micro / "model.safetensors.index.json").write_text("{not json")
    assert "model.safetensors.index.json is not a shard index" in _refusal(micro)


def test_a_pytorch_bin_model_is_accepted_and_loads_and_a_truncated_one_is_refused(micro: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(micro / "model.safetensors")), micro / "pytorch_model.bin")
    (micro / "model.safetensors").unlink()
    check_weight_files(str(micro))
    _loads_with_the_learners_loader(micro)
    weights = micro / "pytorch_model.bin"
    os.truncate(weights, weights.stat().st_size - 64)
    assert "pytorch_model.bin is not a whole PyTorch checkpoint (its zip directory is missing: truncated?)" in (
        _refusal(micro)
    )
    weights.write_bytes(b"\x00" + os.urandom(4095))  # random, but not 0x80 first (a legacy pickle: 1 run in 256)
    assert "pytorch_model.bin is not a PyTorch checkpoint (neither a zip archive nor a pickle)" in _refusal(micro)


def test_another_models_tokenizer_is_refused(micro: Path) -> None:
    from asyncrl.bench.e2e_smol import smol_model_dir

    smol = Path(smol_model_dir(log=lambda *_: None))  # SmolLM2-135M-Instruct (vocab 49152), built once into the cache
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(smol / name, micro / name)
    message = _refusal(micro)
    assert "the tokenizer (tokenizer.json) does not fit the model: prompts can encode to 49135 token ids past " in (
        message
    )
    assert (
        "config.json's vocab_size=16 (up to 49151; e.g. 17 '!'," in message and "vocabulary has 49152 tokens" in message
    )
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(micro))  # the caller's own tokenizer: the same answer
    assert "config.json's vocab_size=16 (up to 49151;" in _refusal(micro, tokenizer=loaded)
    config = json.loads((micro / "tokenizer_config.json").read_text())
    config["add_bos_token"] = False  # transformers rewrites the post-processor: the check loads it with AutoTokenizer
    (micro / "tokenizer_config.json").write_text(json.dumps(config))
    message = _refusal(micro)
    assert "the tokenizer (tokenizer files) does not fit" in message and "vocab_size=16 (up to 49151;" in message


def test_a_tokenizer_that_does_not_load_is_refused(micro: Path) -> None:
    (micro / "tokenizer.json").write_text("{not json")
    assert ": the tokenizer (tokenizer.json, tokenizer_config.json) does not load: " in _refusal(micro)
    (micro / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')  # said only "'added_tokens'" (a KeyError)
    assert "does not load: KeyError: 'added_tokens'" in _refusal(micro)


def test_a_special_token_the_chat_template_writes_must_fit_the_vocab(micro: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(micro))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>"]})  # id 16: past vocab_size 16
    tokenizer.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(micro))
    assert "(up to 16; e.g. 16 '<|user|>';" in _refusal(micro)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the token is never written
    tokenizer.save_pretrained(str(micro))
    check_tokenizer_fits(str(micro))


def test_an_added_text_token_past_the_vocab_is_refused(micro: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(micro))
    tokenizer.add_tokens(["12"])  # not special: matched in any prompt that holds "12"
    tokenizer.save_pretrained(str(micro))
    assert "prompts can encode to 1 token ids past config.json's vocab_size=16 (up to 16; e.g. 16 '12';" in _refusal(
        micro
    )


def test_a_pad_token_past_the_vocab_is_refused(micro: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(micro))
    tokenizer.add_special_tokens({"pad_token": "<extra-pad>"})  # the learner pads its batches with it
    tokenizer.save_pretrained(str(micro))
    assert "(up to 16; e.g. 16 '<extra-pad>';" in _refusal(micro)


def test_a_config_without_vocab_size_is_refused(micro: Path) -> None:
    config = json.loads((micro / "config.json").read_text())
    del config["vocab_size"]
    (micro / "config.json").write_text(json.dumps(config))
    assert _refusal(micro).endswith("config.json has no positive integer vocab_size")


def test_a_broken_chat_template_json_is_refused_naming_it(micro: Path) -> None:
    """A legacy chat_template.json that is not JSON: one line naming the file (it was a JSONDecodeError traceback
    from the tokenizer's constructor at start-up)."""
    (micro / "chat_template.json").write_text('{"chat_template": ')
    assert "chat_template.json: not a JSON object with a chat_template" in _refusal(micro)
