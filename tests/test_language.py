"""User-facing text cites papers, never internal planning notes.

Docstrings, comments, help texts, messages and the docs speak of the project and its users: a paper is cited by
its authors, year and table or section ("LeViT supplementary, Table 1"), not by the working notes the code was
planned from (a numbered seed, issue or session). Source, tests, scripts, benchmarks and the Markdown documents
are read; the JSON results under docs/ are data, left as they were recorded."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PATTERN = re.compile(r"session [0-9]+|issue [0-9]+|seeds?[ -]?0[0-9]{2}", re.IGNORECASE)
SOURCE_SUFFIXES = {".py", ".cpp", ".h"}


def _files() -> list[Path]:
    files = [p for top in ("src", "tests", "scripts", "benchmarks") for p in (ROOT / top).rglob("*")
             if p.suffix in SOURCE_SUFFIXES]
    files += [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]  # not the JSON results
    return sorted(p for p in files if p.is_file() and "__pycache__" not in p.parts)


def test_no_internal_references_in_source_tests_and_docs():
    files = _files()
    assert any(p.name == "README.md" for p in files) and any(p.parts[-2] == "tests" for p in files)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if PATTERN.search(line)]
    assert not hits, "internal references (cite the paper instead):\n" + "\n".join(hits)
