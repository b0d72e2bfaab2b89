"""The product's words say what the code does and what was measured, never how it was built.

`process_word_hits` scans text for a short list of patterns that narrate the building of the
project: work sessions, issue numbers, helpers as agents, worktrees, and dates in prose. A report's
header may say when and where it was measured: a line starting with "Measured" (any file) or one of
the first `HEADER_LINES` lines of a file under docs/results/. The few legitimate uses of a pattern
are allowed by file and pattern, each with its reason (`ALLOWED`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The trees the test reads: the README, the docs (guides and reports), the code and the tests.
SCANNED = ("README.md", "docs/**/*.md", "src/**/*.py", "tests/**/*.py")

HEADER_LINES = 5

PATTERNS: dict[str, re.Pattern[str]] = {
    "session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues? \d+", re.IGNORECASE),
    # A helper as an agent (a code helper — "helper function", "the helpers of common.h" — is fine).
    "helper as agent": re.compile(
        r"\bhelpers?('s|')?\s+(was|were|is|are|editing|working|told|branch|worktree|session|probes?|"
        r"targeted|loaded-machine|run)\b|\b(another|other|second|each|a) helper (editing|working|"
        r"in another)\b",
        re.IGNORECASE),
    "worktree": re.compile(r"\bworktrees?\b", re.IGNORECASE),
    "date in prose": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}

# (path relative to the root, pattern name) -> why the use is legitimate.
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/bounded.py", "session"): "a POSIX process session (start_new_session=True), not a work session",
    ("tests/ops/native/test_isa_levels.py", "session"): "the pytest session the child builds share",
    ("tests/test_process_words.py", "session"): "this file names the patterns and plants them",
    ("tests/test_process_words.py", "issue number"): "this file names the patterns and plants them",
    ("tests/test_process_words.py", "worktree"): "this file names the patterns and plants them",
    ("tests/test_process_words.py", "helper as agent"): "this file names the patterns and plants them",
    ("tests/test_process_words.py", "date in prose"): "this file names the patterns and plants them",
}


def _is_header(relative_path: str, line_number: int, line: str) -> bool:
    """A line that may state when and where a report was measured."""
    if line.lstrip("#*> ").startswith("Measured"):
        return True
    return relative_path.startswith("docs/results/") and line_number <= HEADER_LINES


def process_word_hits(text: str, relative_path: str) -> list[tuple[int, str, str]]:
    """Lines of `text` (the file at `relative_path`) that narrate how the project was built.

    Returns (line number, pattern name, line) for each hit not allowed by `ALLOWED` or, for dates,
    by `_is_header`.
    """
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        for name, pattern in PATTERNS.items():
            if not pattern.search(line) or (relative_path, name) in ALLOWED:
                continue
            if name == "date in prose" and _is_header(relative_path, number, line):
                continue
            hits.append((number, name, line.strip()))
    return hits


def _scanned_files() -> list[Path]:
    return sorted({path for glob in SCANNED for path in ROOT.glob(glob) if path.is_file()})


@pytest.mark.parametrize("planted", [
    "The kernel was rewritten in this session.",
    "Fixed in issue 45, item 3.",
    "A helper editing code in another worktree paused its tests.",
    "The run of 2026-11-28 took 19 minutes.",
])
def test_scanner_flags_planted_process_words(planted: str) -> None:
    text = f"\"\"\"A module.\"\"\"\n# {planted}\nx = 1\n"
    hits = process_word_hits(text, "src/routeformer/planted.py")
    assert hits and hits[0][0] == 2, planted


@pytest.mark.parametrize("legitimate", [
    "The per-block helper NAME_block scores one block.",
    "Helpers shared by the kernel files.",
    "It imports torch and a short list of pure helpers.",
])
def test_scanner_passes_code_helpers(legitimate: str) -> None:
    assert process_word_hits(legitimate, "src/routeformer/planted.py") == []


def test_report_header_may_date_a_measurement() -> None:
    text = "# Ops\n\nMeasured 2026-11-25 08:22 UTC on AMD EPYC.\n\nbody\n\nbody\n\nThe run of 2026-11-25.\n"
    hits = process_word_hits(text, "docs/results/ops.md")
    assert [name for _, name, _ in hits] == ["date in prose"]
    assert hits[0][0] == 9


def test_allowed_entries_are_still_used() -> None:
    for (relative_path, name), reason in ALLOWED.items():
        assert reason
        text = (ROOT / relative_path).read_text(encoding="utf-8")
        assert PATTERNS[name].search(text), f"{relative_path}: allowed {name!r} no longer occurs"


def test_product_words_do_not_narrate_the_build() -> None:
    files = _scanned_files()
    assert len(files) > 100
    found = []
    for path in files:
        relative_path = path.relative_to(ROOT).as_posix()
        for number, name, line in process_word_hits(path.read_text(encoding="utf-8"), relative_path):
            found.append(f"{relative_path}:{number}: {name}: {line[:120]}")
    assert not found, "\n".join(found)
