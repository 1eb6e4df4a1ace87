"""How much text a tokenizer's tokens can stand for: a bound to cut or refuse text by before tokenizing it, so that a
text of megabytes (a prompt to `asyncrl serve`, an environment's observation) costs no more than what can be kept."""

from __future__ import annotations

from typing import Any


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` can stand for: the longest token of its vocabulary (added
    and special tokens included), measured both as written in the vocabulary and decoded alone (a byte-level token
    has at least as many characters as the bytes it decodes to; a decoded SentencePiece token loses its leading
    space), times 4 when the tokenizer's normalizer composes Unicode (NFC, NFKC: up to 4 code points become one, as
    U+1F82 does). Characters a tokenizer deletes (BERT-style clean-up, a run of unknown characters fused into one
    token) are not bounded: such a text is refused as if they were kept. Computed once at start-up (a fast
    tokenizer decodes a 150k vocabulary in a fraction of a second)."""
    # a fast tokenizer decodes the whole vocabulary in Rust: transformers' (`backend_tokenizer`) or `FastTokenizer`'s
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "backend", None)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else backend.get_vocab(with_added_tokens=True)
    ids = [[token_id] for token_id in sorted(set(vocab.values()))]
    if backend is not None:
        decoded = backend.decode_batch(ids, skip_special_tokens=False)
    else:
        decoded = [tokenizer.decode(one, skip_special_tokens=False, clean_up_tokenization_spaces=False) for one in ids]
    longest = max(1, *map(len, vocab), *map(len, decoded))
    normalizer = repr(getattr(backend, "normalizer", None))
    composes = any(kind in normalizer for kind in ("NFC", "NFKC", "Precompiled"))  # Precompiled: SentencePiece's NFKC
    return longest * (4 if composes else 1)
