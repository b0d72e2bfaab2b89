"""Module docstrings in attention/ and ops/ state a contract in at most MAX_LINES lines; the longer
ones are kernels' correctness arguments, allowed by name with the reason."""

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "routeformer"
MAX_LINES = 40
ALLOWED = {
    "ops/expanding/op.py": "the correctness argument of the expanding kernel's passes (what each pass "
                           "reads, why the rows it skips cannot change the output)",
    "ops/mita/op.py": "the correctness argument of the causal MiTA kernel (block layout, what a query "
                      "may read, why streaming equals the parallel pass), with its diagram",
}


def docstring_lines(path: Path) -> int:
    docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return 0 if docstring is None else docstring.count("\n") + 1


def long_docstrings(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    return {str(path.relative_to(root)): lines
            for folder in ("attention", "ops") for path in sorted((root / folder).rglob("*.py"))
            if (lines := docstring_lines(path)) > limit}


def test_module_docstrings_of_attention_and_ops_are_at_most_40_lines_or_allowed_by_name():
    too_long = {name: lines for name, lines in long_docstrings(SOURCE).items() if name not in ALLOWED}
    assert too_long == {}, f"module docstrings over {MAX_LINES} lines (measurements and history go to docs/)"


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_every_allowed_docstring_is_still_long(name):
    # an allowance that is no longer needed leaves the list
    assert docstring_lines(SOURCE / name) > MAX_LINES


def test_the_check_fails_on_a_long_docstring(tmp_path):
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "long.py").write_text('"""' + "line\n" * MAX_LINES + '"""\n')
    (tmp_path / "attention" / "short.py").write_text('"""One line."""\n')
    assert long_docstrings(tmp_path) == {"attention/long.py": MAX_LINES + 1}
