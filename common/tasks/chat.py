"""Prompt text -> token ids, one way for every process: the rollout worker, the learner's eval and the start-up check.

`PromptEncoder(tokenizer, data_cfg, messages=...)` turns a `Problem.prompt` into the token ids the engine generates
from. A prompt is text, or (a `dataset` source whose prompts are message lists, `messages=True`) the JSON text of a
list of `{role, content}` messages. `data.system_prompt`, when set, is put first unless the messages already start
with a system message. `data.chat_template`:

    auto   the tokenizer's chat template when the prompt is a message list, or when the tokenizer has a template and
           `data.system_prompt` is set; otherwise plain text
    true   always the template (a tokenizer without one is refused)
    false  never: the message contents (system prompt included) joined with blank lines, as plain text

With the template the ids are `tokenizer(apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
add_special_tokens=False)` (the template writes its own BOS); plain text is `tokenizer(text)` (special tokens added
as the tokenizer does), exactly what the worker did before templates existed.

`check_prompt_lengths` tokenizes a sample of the training stream (up to `SAMPLE_PROMPTS` prompts) and the eval set
at start. It refuses, with the numbers, a dataset none of whose prompts fit `max context - rollout.max_new_tokens`,
or whose prompts the tokenizer cannot write (no tokens, or special and unknown tokens only); when only some do not
fit it returns a warning with their share (the workers skip them).

`prompt_encoder(model_dir, ...)` picks the tokenizer: `FastTokenizer` (the `tokenizers` library alone) when it gives
the same ids as transformers and no chat template is applied, else `AutoTokenizer`. transformers is imported inside
functions, only when needed: it costs about two CPU-seconds per process (`common` stays torch-free).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.model_files import ModelFilesError
from common.tasks import DatasetError

if TYPE_CHECKING:
    from common.config import Config, DataConfig
    from common.tasks import PromptSource

SAMPLE_PROMPTS = 4096
"""Training prompts tokenized by the start-up check (a whole dataset up to this size)."""


def load_tokenizer(model_dir: str, trust_remote_code: bool = False) -> Any:
    """The Hugging Face tokenizer of a model (or tokenizer) directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_class` values with which transformers uses `tokenizer.json` as it is (a model-specific class may
rebuild the backend from the vocabulary and merges with its own pre-tokenizer): only these take the fast path."""
_REWRITING_KEYS = ("add_bos_token", "add_eos_token")
"""tokenizer_config.json keys with which transformers rewrites the post-processor (even when false)."""
_ADJUSTING_KEYS = ("add_prefix_space", "split_special_tokens", "clean_up_tokenization_spaces", "fix_mistral_regex")
"""tokenizer_config.json keys with which transformers changes encoding or decoding when they are true."""
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class FastTokenizer:
    """A model's `tokenizer.json` read with `tokenizers` alone, no transformers import (a fraction of a CPU-second
    where `AutoTokenizer` costs two): the start-up check counts prompts with it and the rollout worker encodes and
    decodes with it when no chat template is applied. For a directory `usable` accepts, `encode`/`decode` give
    exactly what the Hugging Face tokenizer gives (`tokenizer(text)["input_ids"]`, `decode(ids,
    skip_special_tokens=...)`); any other directory goes through `AutoTokenizer`."""

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.backend.no_truncation()  # as transformers encodes without `truncation=`/`padding=`
        self.backend.no_padding()
        config = _tokenizer_config(model_dir) or {}
        jinja, legacy = Path(model_dir) / "chat_template.jinja", Path(model_dir) / "chat_template.json"
        self.chat_template = config.get("chat_template") or (jinja.read_text() if jinja.is_file() else None)
        if not self.chat_template and legacy.is_file():
            try:
                self.chat_template = json.loads(legacy.read_text(encoding="utf-8")).get("chat_template")
            except (ValueError, AttributeError) as err:  # not JSON, not UTF-8, or not an object
                raise ModelFilesError(
                    f"model.path={model_dir}: chat_template.json: not a JSON object with a chat_template ({err})"
                ) from None
        added = self.backend.get_added_tokens_decoder()
        self.all_special_ids = [token_id for token_id, token in added.items() if token.special]
        unk = _token_text(config.get("unk_token"))
        self.unk_token_id = self.backend.token_to_id(unk) if unk is not None else None

    @staticmethod
    def usable(model_dir: str) -> bool:
        """Whether transformers would load this directory's `tokenizer.json` unchanged: a generic tokenizer class
        (`GENERIC_TOKENIZER_CLASSES`), no code of its own (`auto_map`), no option that changes encoding or
        decoding (`_REWRITING_KEYS`, `_ADJUSTING_KEYS`), a post-processor (transformers writes one when there is
        none), every special token the config names already in the vocabulary (transformers adds the others), and
        no legacy `special_tokens_map.json` / `added_tokens.json`."""
        root = Path(model_dir)
        config = _tokenizer_config(model_dir)
        if config is None or not (root / "tokenizer.json").is_file() or "auto_map" in config:
            return False
        if config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
            return False
        if any(key in config for key in _REWRITING_KEYS) or any(config.get(key) for key in _ADJUSTING_KEYS):
            return False
        if (root / "special_tokens_map.json").exists() or (root / "added_tokens.json").exists():
            return False
        try:
            backend = json.loads((root / "tokenizer.json").read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(backend, dict) or backend.get("post_processor") is None:
            return False
        present = {token.get("content") for token in backend.get("added_tokens") or [] if isinstance(token, dict)}
        named = [_token_text(config.get(key)) for key in _NAMED_SPECIALS]
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        named += [_token_text(token) for token in (extra.values() if isinstance(extra, dict) else extra)]
        named += [_token_text(token) for token in (config.get("added_tokens_decoder") or {}).values()]
        return all(token in present for token in named if token is not None)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


CountingTokenizer = FastTokenizer
"""The name the start-up check used first."""


def _tokenizer_config(model_dir: str) -> dict[str, Any] | None:
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _token_text(token: Any) -> str | None:
    """A special token's text, whether tokenizer_config.json writes it as a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def source_has_messages(source: PromptSource) -> bool:
    """Whether a source's prompts are JSON message lists (a `dataset` source over chat messages)."""
    return bool(getattr(source, "messages", False))


class PromptEncoder:
    """Callable: prompt text (or JSON message list) -> token ids, per `data.chat_template` / `data.system_prompt`."""

    def __init__(self, tokenizer: Any, data_cfg: DataConfig, *, messages: bool) -> None:
        self.tokenizer, self.messages, self.system_prompt = tokenizer, messages, data_cfg.system_prompt
        has_template = bool(getattr(tokenizer, "chat_template", None))
        mode = data_cfg.chat_template
        wants_template = messages or (has_template and bool(self.system_prompt))
        self.templated = mode == "true" or (mode == "auto" and wants_template)
        if self.templated and not has_template:
            why = "the prompts are chat messages (data.prompt_key)" if mode == "auto" else "data.chat_template=true"
            raise DatasetError(
                f"{why} but the tokenizer of the model has no chat template (`chat_template` in "
                "tokenizer_config.json); use an instruct model's tokenizer, or set data.chat_template=false to join "
                "the message contents with blank lines"
            )

    @classmethod
    def for_source(cls, tokenizer: Any, data_cfg: DataConfig, source: PromptSource) -> PromptEncoder:
        return cls(tokenizer, data_cfg, messages=source_has_messages(source))

    def chat(self, prompt: str) -> list[dict[str, str]]:
        """The messages of a prompt, system prompt first when set."""
        chat = json.loads(prompt) if self.messages else [{"role": "user", "content": prompt}]
        if self.system_prompt and (not chat or chat[0].get("role") != "system"):
            chat = [{"role": "system", "content": self.system_prompt}, *chat]
        return chat

    def text(self, prompt: str) -> str:
        """The text the tokenizer encodes (with the template: rendered, generation prompt included)."""
        if self.templated:
            return self.tokenizer.apply_chat_template(self.chat(prompt), tokenize=False, add_generation_prompt=True)
        if not self.messages and not self.system_prompt:
            return prompt
        return "\n\n".join(message["content"] for message in self.chat(prompt))

    def __call__(self, prompt: str) -> list[int]:
        text = self.text(prompt)
        return list(self.tokenizer(text, add_special_tokens=not self.templated)["input_ids"])


def prompt_encoder(model_dir: str, data_cfg: DataConfig, *, messages: bool, trust_remote_code: bool) -> PromptEncoder:
    """The prompt encoder of a model directory, cheapest first: `FastTokenizer` (no transformers import) when the
    directory is `FastTokenizer.usable` and no chat template is applied, else the Hugging Face tokenizer. The
    encoder's `tokenizer` also decodes responses (`decode(ids, skip_special_tokens=True)`)."""
    if FastTokenizer.usable(model_dir):
        encode = PromptEncoder(FastTokenizer(model_dir), data_cfg, messages=messages)
        if not encode.templated:
            return encode
    return PromptEncoder(load_tokenizer(model_dir, trust_remote_code), data_cfg, messages=messages)


def check_prompt_lengths(
    source: PromptSource, encode: PromptEncoder, *, max_context: int, max_new_tokens: int, context_note: str = ""
) -> str | None:
    """Tokenize a sample of training prompts and the eval set; DatasetError when none can be generated (no tokens,
    or longer than `max_context - max_new_tokens`); a warning naming the share that does not fit, or None."""
    size = source.epoch_size()
    count = SAMPLE_PROMPTS if size is None else min(size, SAMPLE_PROMPTS)
    what = f"all {count} prompts" if size is not None and count == size else f"a sample of {count} prompts"
    tokenizer = encode.tokenizer
    meaningless = {*getattr(tokenizer, "all_special_ids", ()), getattr(tokenizer, "unk_token_id", None)}
    lengths, unreadable = [], 0
    for i in range(count):
        ids = encode(source.train(i).prompt)
        lengths.append(len(ids))
        unreadable += all(token in meaningless for token in ids)
    room = max_context - max_new_tokens
    where = f"the model's context of {max_context} tokens{context_note} minus rollout.max_new_tokens={max_new_tokens}"
    if unreadable == count:
        example = source.train(0).prompt[:80]
        raise DatasetError(
            f"the tokenizer encodes none of {what} of the dataset to any token but special or unknown ones: its "
            f"vocabulary cannot write this text (first prompt: {example!r}); use a model whose tokenizer covers the "
            "dataset's characters"
        )
    fits = [n for n in lengths if 0 < n <= room]
    if not fits:
        nonempty = sorted(n for n in lengths if n > 0)
        raise DatasetError(
            f"no prompt fits the model: {what} have {nonempty[0]} to {nonempty[-1]} tokens (median "
            f"{statistics.median(nonempty):g}), but {where} leaves {room} tokens for a prompt; use a model with a "
            "longer context, fewer rollout.max_new_tokens or shorter prompts (data.max_prompt_tokens, task=dataset)"
        )
    eval_lengths = [len(encode(problem.prompt)) for problem in source.eval_set()]
    notes = []
    if len(fits) < len(lengths):
        dropped = len(lengths) - len(fits)
        notes.append(
            f"{dropped} of {what} ({100 * dropped / len(lengths):.1f}%) do not fit {where} ({room} tokens) or encode "
            "to no tokens: the rollout workers skip them"
        )
    if unreadable:
        notes.append(f"{unreadable} of {what} encode to special or unknown tokens only")
    eval_misfits = sum(1 for n in eval_lengths if not 0 < n <= room)
    if eval_misfits:
        notes.append(f"{eval_misfits} of the {len(eval_lengths)} eval prompts do not fit either")
    return "; ".join(notes) or None


def check_prompts_fit(source: PromptSource, cfg: Config, model_dir: str, max_positions: int) -> str | None:
    """The start-up check of a run: `check_prompt_lengths` with the model's tokenizer and context (the embedded
    engine's `min(rollout.max_seq_len, max_position_embeddings)`; SGLang's server: max_position_embeddings). The
    message it returns also counts the rows `data.max_prompt_tokens` dropped."""
    trust = cfg.model.trust_remote_code
    encode = prompt_encoder(model_dir, cfg.data, messages=source_has_messages(source), trust_remote_code=trust)
    if cfg.rollout.backend == "embedded" and cfg.rollout.max_seq_len < max_positions:
        max_context, note = cfg.rollout.max_seq_len, f" (rollout.max_seq_len; max_position_embeddings={max_positions})"
    else:
        max_context, note = max_positions, " (max_position_embeddings)"
    warning = check_prompt_lengths(
        source, encode, max_context=max_context, max_new_tokens=cfg.rollout.max_new_tokens, context_note=note
    )
    dropped, eval_dropped = getattr(source, "dropped", 0), getattr(source, "eval_dropped", 0)
    if dropped or eval_dropped:
        total = dropped + (source.epoch_size() or 0)
        limit = cfg.data.max_prompt_tokens
        note = f"{dropped} of {total} rows ({100 * dropped / total:.1f}%) dropped: longer than data.max_prompt_tokens"
        note += f"={limit} tokens" + (f" ({eval_dropped} of data.eval_path too)" if eval_dropped else "")
        warning = f"{note}; {warning}" if warning else note
    return warning
