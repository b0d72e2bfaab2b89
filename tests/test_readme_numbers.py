"""README.md is a product page: short, small table cells, and every measured number it quotes is
found in the report the same line links to."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 130
MAX_CELL_WORDS = 40
# A measured figure: a decimal (0.50, +0.004, 47.7) or a duration in seconds (505 s).
FIGURE = re.compile(r"(?<![\w.])[+−-]?(\d+\.\d+|\d+(?= s\b))")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def unmatched_figures(line: str, base: Path) -> list[str]:
    """The figures on `line` that none of the local files it links to contains; every figure when
    the line links to no local file."""
    line = re.sub(r"arXiv \d+\.\d+", "", line)  # a paper's id is not a figure
    figures = [match.group(1) for match in FIGURE.finditer(re.sub(r"\([^)]*\)", _keep_text, line))]
    if not figures:
        return []
    texts = [(base / target).read_text(encoding="utf-8") for target in LINK.findall(line)
             if not target.startswith(("http://", "https://")) and (base / target).is_file()]
    return [figure for figure in figures
            if not any(re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", text) for text in texts)]


def _keep_text(match: re.Match) -> str:
    """Link targets hold no figures (a path such as code_lm-4096 is not a number); other
    parentheses keep their text."""
    inner = match.group(0)
    return "()" if re.fullmatch(r"\(\S+\)", inner) and ("/" in inner or inner.endswith(".md)")) else inner


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"


def test_readme_table_cells_are_short():
    long_cells = []
    for number, line in prose_lines(README.read_text(encoding="utf-8")):
        if line.startswith("|"):
            for cell in line.strip().strip("|").split("|"):
                if len(cell.split()) > MAX_CELL_WORDS:
                    long_cells.append(f"line {number}: {len(cell.split())} words: {cell.strip()[:60]}...")
    assert not long_cells, "\n".join(long_cells)


def test_readme_has_the_decision_table():
    text = README.read_text(encoding="utf-8")
    assert "## Which mechanism for what" in text
    table = text.split("## Which mechanism for what", 1)[1].split("\n## ", 1)[0]
    needs = [row.split("|")[1].strip() for row in table.splitlines()
             if row.startswith("|") and not row.startswith("|---")][1:]
    for need in ("long-context", "recall", "decoding", "short T", "pretrained"):
        assert any(need in row for row in needs), f"no row of the decision table for {need!r}"


def test_every_readme_figure_is_in_the_report_it_links():
    mismatches = []
    for number, line in prose_lines(README.read_text(encoding="utf-8")):
        missing = unmatched_figures(line, ROOT)
        if missing:
            mismatches.append(f"line {number}: {', '.join(missing)} not in the linked report(s)")
    assert not mismatches, "\n".join(mismatches)


def test_the_check_fails_on_a_planted_figure(tmp_path):
    (tmp_path / "report.md").write_text("| topk | 0.9996 ± 0.0010 | 0.50 |\n| prefill | 505 s |\n")
    assert unmatched_figures("accuracy 0.9996 at 0.50x in 505 s ([r](report.md))", tmp_path) == []
    assert unmatched_figures("accuracy 0.9997 at 0.50x ([r](report.md))", tmp_path) == ["0.9997"]
    assert unmatched_figures("at 0.5x ([r](report.md))", tmp_path) == ["0.5"]
    assert unmatched_figures("accuracy 0.9996, no link", tmp_path) == ["0.9996"]
    assert unmatched_figures("T=4096, 3 seeds, arXiv 2602.01219", tmp_path) == []
