"""Every relative link in README.md and docs/**/*.md resolves inside the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# [text](target) and [text]: target (reference definitions); images too. Code spans are skipped.
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # fenced code holds no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return INLINE.findall(text) + REFERENCE.findall(text)


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path.read_text(encoding="utf-8")):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0].split("?", 1)[0]
        if not file:
            continue
        resolved = (ROOT / file.lstrip("/")) if file.startswith("/") else (path.parent / file)
        resolved = resolved.resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (missing)")
    return broken


def test_the_link_finder_finds_and_judges_links(tmp_path):
    text = "[a](docs/x.md) ![p](img.png \"t\") `[no](code.md)` [w](https://e.org)\n[r]: ../up.md\n"
    assert links(text) == ["docs/x.md", "img.png", "https://e.org", "../up.md"]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(path):
    assert broken_links(path) == []
