"""Start-up checks of a model directory's weight files and tokenizer: faults that would otherwise surface only once
the run has started (the learner's `from_pretrained` raising, or every rollout lease refused) fail here, before
anything starts, with one line naming the directory, the file and the fault.

- Weights (`check_weight_files`): the file the learner's `AutoModelForCausalLM.from_pretrained` would load, found
  in transformers' order (config.json's `transformers_weights`, else `model.safetensors`, a sharded
  `model.safetensors.index.json`, `pytorch_model.bin`, `pytorch_model.bin.index.json`). A safetensors file must
  be whole: its 8-byte header length and JSON header are read and the file must end exactly where the header says
  its tensor data ends (no tensor is read; then `safetensors.safe_open`, which maps the file without reading it,
  validates the rest of the header). An index must name shards that exist, and each shard must hold the tensors
  the index assigns to it. A `pytorch_model.bin` (loaded with `torch.load(weights_only=True)`) must be a readable
  zip archive holding a `data.pkl`, or a legacy pickle.
- Tokenizer (`check_tokenizer_fits`): every token id that encoding a prompt can produce must be below config.json's
  `vocab_size`; see its docstring for which ids those are.

Torch-free and quick to import: `tokenizers`/`transformers` and `safetensors` are imported when a check runs.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

SAFETENSORS_MAX_HEADER_BYTES = 100_000_000
"""The largest JSON header the safetensors library accepts."""
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The weight files `from_pretrained` looks for in a local directory, in the order it takes the first present."""
PROBE_TEXT = "0"
"""Text encoded to see the special tokens the tokenizer's post-processor inserts (BOS, ...)."""
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ModelFilesError(ValueError):
    """A model directory whose weight files or tokenizer cannot serve the run; the message is one line that names
    the directory (as `model.path=...`), the file and the fault."""


def check_model_files(model_dir: str, *, trust_remote_code: bool = False, tokenizer: Any = None) -> None:
    """`check_weight_files` and `check_tokenizer_fits`: ModelFilesError for the first fault found."""
    check_weight_files(model_dir)
    check_tokenizer_fits(model_dir, tokenizer=tokenizer, trust_remote_code=trust_remote_code)


def check_weight_files(model_dir: str) -> None:
    """ModelFilesError unless the weight file that `from_pretrained` would load (see the module docstring) is
    present and whole, with every shard an index names. Reads headers only, never tensor data."""
    root = Path(model_dir)
    explicit = _config(model_dir).get("transformers_weights")
    if isinstance(explicit, str) and explicit:
        name = explicit
        if not (root / name).is_file():
            raise ModelFilesError(f"model.path={model_dir}: {name} (config.json's transformers_weights) is missing")
    else:
        name = next((candidate for candidate in WEIGHT_FILES if (root / candidate).is_file()), "")
        if not name:
            raise ModelFilesError(
                f"model.path={model_dir}: no weights: none of {', '.join(WEIGHT_FILES)} is there (a copy cut short?)"
            )
    if name.endswith(".index.json"):
        _check_index(model_dir, name)
    elif name.endswith(".safetensors"):
        _check_safetensors(model_dir, name)
    else:
        _check_torch_file(model_dir, name)


def check_safetensors_file(model_dir: str, name: str) -> None:
    """ModelFilesError unless `model_dir/name` is a whole safetensors file (as `check_weight_files` checks one)."""
    _check_safetensors(model_dir, name)


def _config(model_dir: str) -> dict[str, Any]:
    """config.json, or {} where it is missing or broken (`ArchConfig.from_model_dir` names that fault)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _check_safetensors(model_dir: str, name: str) -> set[str]:
    """The tensor names of a whole safetensors file; ModelFilesError naming what is wrong with it otherwise."""
    path = Path(model_dir) / name
    where = f"model.path={model_dir}: {name}"
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            header = handle.read(header_len) if header_len and header_len <= SAFETENSORS_MAX_HEADER_BYTES else b""
    except OSError as err:
        raise ModelFilesError(f"{where} cannot be read: {err.strerror or err}") from None
    if header_len is None:
        raise ModelFilesError(f"{where} is not a safetensors file ({size} bytes: empty or truncated?)")
    if header_len > SAFETENSORS_MAX_HEADER_BYTES or not header.startswith(b"{"):
        raise ModelFilesError(f"{where} is not a safetensors file (no JSON header at its start: another format?)")
    if len(header) < header_len:
        raise ModelFilesError(
            f"{where} is not a safetensors file (its header is incomplete: truncated? the header alone should be "
            f"{header_len} bytes, the file has {size})"
        )
    try:
        entries = json.loads(header)
        tensors = {key: value for key, value in entries.items() if key != "__metadata__"}
        data_end = max((int(value["data_offsets"][1]) for value in tensors.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ModelFilesError(f"{where} is not a safetensors file (its header is not valid JSON metadata)") from None
    expected = 8 + header_len + data_end
    if size < expected:
        raise ModelFilesError(
            f"{where} is truncated: its header describes {expected} bytes, the file has {size} (a copy cut short?)"
        )
    if size > expected:
        raise ModelFilesError(
            f"{where} is not a whole safetensors file: {size - expected} bytes follow the {expected} its header "
            "describes (the safetensors loader refuses it)"
        )
    from safetensors import SafetensorError, safe_open  # maps the file and validates the header; reads no tensor

    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError) as err:
        raise ModelFilesError(f"{where} is not a valid safetensors file: {err}") from None
    return set(tensors)


def _check_torch_file(model_dir: str, name: str) -> None:
    """ModelFilesError unless `name` looks loadable by `torch.load`: a zip archive (torch.save's format since 1.6)
    with a readable central directory and a data.pkl, or a legacy pickle (not checked further)."""
    path = Path(model_dir) / name
    where = f"model.path={model_dir}: {name}"
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as err:
        raise ModelFilesError(f"{where} cannot be read: {err.strerror or err}") from None
    if magic[:1] == b"\x80":  # a legacy (pre-zip) torch.save pickle: nothing cheap to check
        return
    if magic != b"PK\x03\x04":
        raise ModelFilesError(f"{where} is not a PyTorch checkpoint (neither a zip archive nor a pickle)")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        raise ModelFilesError(
            f"{where} is not a whole PyTorch checkpoint (its zip directory is missing: truncated?)"
        ) from None
    if not any(member.endswith("data.pkl") for member in names):
        raise ModelFilesError(f"{where} is not a PyTorch checkpoint (its zip archive has no data.pkl)")


def _check_index(model_dir: str, name: str) -> None:
    """ModelFilesError unless the sharded index `name` maps tensors to shard files that are all there and whole,
    and (for safetensors shards) each holds the tensors the index assigns to it."""
    where = f"model.path={model_dir}: {name}"
    try:
        weight_map = json.loads((Path(model_dir) / name).read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError
        shards: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str):
                raise ValueError
            shards.setdefault(shard, []).append(tensor)
    except OSError as err:
        raise ModelFilesError(f"{where} cannot be read: {err.strerror or err}") from None
    except (ValueError, TypeError, KeyError):
        raise ModelFilesError(f"{where} is not a shard index (no JSON object with a weight_map of files)") from None
    root = Path(model_dir).resolve()
    missing = []
    for shard in shards:
        path = (root / shard).resolve()
        if not path.is_relative_to(root):
            raise ModelFilesError(f"{where} names a shard outside the model directory: {shard}")
        if not path.is_file():
            missing.append(shard)
    if missing:
        listed = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelFilesError(
            f"model.path={model_dir}: {listed}: {len(missing)} of the {len(shards)} shards {name} names "
            f"{'is' if len(missing) == 1 else 'are'} missing"
        )
    for shard, tensors in shards.items():
        if not shard.endswith(".safetensors"):
            _check_torch_file(model_dir, shard)
            continue
        absent = [tensor for tensor in tensors if tensor not in _check_safetensors(model_dir, shard)]
        if absent:
            raise ModelFilesError(
                f"model.path={model_dir}: {shard} lacks {len(absent)} of the tensors {name} assigns to it "
                f"({', '.join(absent[:3])}): a shard of another model?"
            )


def check_tokenizer_fits(model_dir: str, *, tokenizer: Any = None, trust_remote_code: bool = False) -> None:
    """ModelFilesError unless every token id that encoding a prompt can produce lies below config.json's
    `vocab_size` (else every rollout worker refuses every prompt, forever).

    Those ids are: the whole vocabulary except special added tokens (the base vocabulary, and added tokens that
    are not special, which the tokenizer matches in any text); the special tokens its post-processor inserts
    (BOS, ...: seen by encoding a probe text); the unknown token (any unknown character maps to it); the special
    tokens the chat template writes (those whose text it holds literally, or which it names as `bos_token`,
    `eos_token`, ...); and the pad token (the learner pads its batches with it, or with EOS where there is none).
    Not `len(tokenizer)`: a special token used only to stop generation may lie past the model's vocabulary on
    purpose, as the decode benchmark's unreachable EOS does (asyncrl/bench/e2e_workloads.py), and the model can
    never emit it; such a token reaches a prompt only if a prompt spells it out, which the tokenizer of any model
    allows for its own specials too.

    `tokenizer`: a Hugging Face tokenizer the caller has loaded already. Else the directory's `tokenizer.json` is
    read with `tokenizers` alone where transformers would use it unchanged (`FastTokenizer.usable`, a fraction of a
    second), or loaded with `AutoTokenizer` (seconds)."""
    vocab_size = _config(model_dir).get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise ModelFilesError(f"model.path={model_dir}: config.json has no positive integer vocab_size")
    view = _TokenizerView.of(model_dir, tokenizer, trust_remote_code)
    reachable = view.reachable_ids()
    beyond = sorted(token_id for token_id in reachable if token_id >= vocab_size)
    if beyond:
        shown = ", ".join(f"{token_id} {reachable[token_id]!r}" for token_id in beyond[:3])
        raise ModelFilesError(
            f"model.path={model_dir}: the tokenizer ({view.source}) does not fit the model: prompts can encode to "
            f"{len(beyond)} token ids past config.json's vocab_size={vocab_size} (up to {beyond[-1]}; e.g. {shown}; "
            f"the vocabulary has {len(view.vocab)} tokens): a tokenizer of another model?"
        )


class _TokenizerView:
    """What `check_tokenizer_fits` needs of a tokenizer, from a Hugging Face tokenizer or a bare `tokenizer.json`."""

    def __init__(self, source: str, vocab: dict[str, int], specials: dict[int, str], probe_ids: list[int],
                 named: dict[str, int | None], chat_template: str) -> None:  # fmt: skip
        self.source = source
        self.vocab = vocab
        """Every token (base vocabulary and added tokens) by text."""
        self.specials = specials
        """The special added tokens' text by id."""
        self.probe_ids, self.named, self.chat_template = probe_ids, named, chat_template

    @classmethod
    def of(cls, model_dir: str, tokenizer: Any, trust_remote_code: bool) -> _TokenizerView:
        if tokenizer is not None:
            return cls.of_hf(tokenizer, "the tokenizer given")
        from common.tasks.chat import FastTokenizer

        if FastTokenizer.usable(model_dir):
            return cls.of_file(model_dir)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except Exception as err:  # any loader fault (transformers raises many kinds): name it on one line
            fault = " ".join(str(err).split())[:300]  # a KeyError's text is only the key: its type says what it is
            kind = f"{type(err).__name__}: " if isinstance(err, LookupError) or not fault else ""
            files = ", ".join(
                name for name in ("tokenizer.json", "tokenizer_config.json") if (Path(model_dir) / name).is_file()
            )
            raise ModelFilesError(
                f"model.path={model_dir}: the tokenizer ({files or 'no tokenizer file'}) does not load: {kind}{fault}"
            ) from None
        return cls.of_hf(tokenizer, "tokenizer files")

    @classmethod
    def of_hf(cls, tokenizer: Any, source: str) -> _TokenizerView:
        specials = {int(i): str(token.content) for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        named = {name: getattr(tokenizer, f"{name}_id", None) for name in _NAMED_SPECIALS}
        template = tokenizer.chat_template or ""
        template = " ".join(template.values()) if isinstance(template, dict) else str(template)
        return cls(source, dict(tokenizer.get_vocab()), specials, list(tokenizer(PROBE_TEXT)["input_ids"]), named,
                   template)  # fmt: skip

    @classmethod
    def of_file(cls, model_dir: str) -> _TokenizerView:
        from common.tasks.chat import FastTokenizer

        fast = FastTokenizer(model_dir)
        backend = fast.backend
        specials = {
            int(i): str(token.content) for i, token in backend.get_added_tokens_decoder().items() if token.special
        }
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        named = {}
        for name in _NAMED_SPECIALS:
            token = config.get(name)
            text = token.get("content") if isinstance(token, dict) else token
            named[name] = backend.token_to_id(text) if isinstance(text, str) else None
        probe_ids = backend.encode(PROBE_TEXT, add_special_tokens=True).ids
        return cls("tokenizer.json", backend.get_vocab(with_added_tokens=True), specials, probe_ids, named,
                   fast.chat_template or "")  # fmt: skip

    def reachable_ids(self) -> dict[int, str]:
        """The ids encoding a prompt can produce (see `check_tokenizer_fits`), each with its token's text."""
        text_of = {token_id: text for text, token_id in self.vocab.items()}
        reachable = {token_id: text for token_id, text in text_of.items() if token_id not in self.specials}
        for token_id in self.probe_ids:
            reachable[token_id] = text_of.get(token_id, "?")
        for name in ("unk_token", "pad_token"):
            token_id = self.named.get(name)
            if token_id is not None:
                reachable[token_id] = self.specials.get(token_id, text_of.get(token_id, name))
        if self.named.get("pad_token") is None and self.named.get("eos_token") is not None:
            eos = self.named["eos_token"]  # the learner pads with EOS where there is no pad token
            reachable[eos] = text_of.get(eos, "eos_token")
        if self.chat_template:
            for token_id, text in self.specials.items():
                if text and text in self.chat_template:
                    reachable[token_id] = text
            for name, token_id in self.named.items():
                if token_id is not None and name in self.chat_template:
                    reachable[token_id] = text_of.get(token_id, name)
        return reachable
