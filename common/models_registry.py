"""Names of the built-in model recipes (`model.path: builtin:<name>`), importable without torch.

The recipes themselves (architecture, tokenizer, warm-up) live in `common.builtin_model`.
"""

from __future__ import annotations

BUILTIN_MODELS: dict[str, str] = {
    "tiny": "Llama-family, ~0.8M parameters, char-level tokenizer, warmed up on built-in arithmetic (~2.5 min once)",
    "micro": "the same family at ~25k parameters, barely trained: for smoke tests (seconds to build)",
    "tiny-outliers": "builtin:tiny with 3 outlier activation channels (x64), as real LLMs have: W8A8 rollout bites",
    "tiny-tool": "tiny-sized, vocabulary plus `[]{}`, warmed up to call a calculator (data.task=arith_tool)",
    "micro-tool": "builtin:tiny-tool's recipe at 2 layers of 64, warmed up briefly: for tests (a minute to build)",
}
