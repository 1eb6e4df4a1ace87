"""docs/algorithms.md, the project's extensions to the design sheet ALGORITHMS.md, stays complete and citable.

- Every key of the config schema is named in docs/algorithms.md: in a section with its formula, in "Keys without a
  formula", or in "Keys defined in ALGORITHMS.md" (the sheet lives beside the design docs, outside this repository).
- Every citation of a section, such as `docs/algorithms.md, "Loss mask"` or `ALGORITHMS.md, "Precision"` (a comma,
  or a space and an optional parenthesis, before the quote), in code, configs and docs, names a heading that exists:
  one of
  docs/algorithms.md's `## ` headings, or one of the sheet's sections as docs/algorithms.md lists them.
"""

from __future__ import annotations

import re
from pathlib import Path

from common.config_schema import all_keys

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "algorithms.md"
SCANNED_DIRS = ("asyncrl", "buffer", "common", "configs", "docs", "learner", "quant_sync", "rollout_workers", "tests")
SCANNED_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml"}
SHEET_SECTIONS_LINE = "The sheet's sections, for citations:"
CITATION = re.compile(r'(docs/algorithms\.md|(?<![\w/])ALGORITHMS\.md)(?:,\s*|\s+\(?)"([^"]{1,100})"')


def _doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def _headings(text: str) -> set[str]:
    return {line[3:].strip() for line in text.splitlines() if line.startswith("## ")}


def _sheet_sections(text: str) -> set[str]:
    """The sheet's section names as docs/algorithms.md lists them (one paragraph, names separated by `;`)."""
    start = text.index(SHEET_SECTIONS_LINE) + len(SHEET_SECTIONS_LINE)
    paragraph = text[start:].split("\n\n", 1)[0]
    return {name.strip().rstrip(".") for name in " ".join(paragraph.split()).split(";")}


def _scanned_files() -> list[Path]:
    files = [REPO / "README.md"]
    for top in SCANNED_DIRS:
        files += [p for p in (REPO / top).rglob("*") if p.suffix in SCANNED_SUFFIXES and p.is_file()]
    return [p for p in files if "__pycache__" not in p.parts]


def _unwrapped(text: str) -> str:
    """The text with line breaks, indentation and comment leaders (`#`, `//`) joined into single spaces, so that a
    citation wrapped over two lines of a comment or docstring reads as one."""
    return re.sub(r"\s*\n\s*(?:#+|//)?\s*", " ", text)


def test_every_config_key_is_named_in_docs_algorithms() -> None:
    text = _doc_text()
    missing = [key for key in all_keys() if not re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text)]
    assert not missing, (
        f"config keys not named in docs/algorithms.md: {missing}; document each in its section (formula, default, "
        "file), or list an operational key in its 'Keys without a formula' table"
    )


def test_citations_name_existing_sections() -> None:
    text = _doc_text()
    headings, sheet = _headings(text), _sheet_sections(text)
    assert "Loss mask" in headings and "Mismatch weightings" in sheet  # the parsers read what they should
    bad = []
    for path in _scanned_files():
        for target, section in CITATION.findall(_unwrapped(path.read_text(encoding="utf-8", errors="replace"))):
            known = headings if target == "docs/algorithms.md" else sheet
            if section not in known:
                bad.append(f"{path.relative_to(REPO)}: {target}, {section!r}")
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)
