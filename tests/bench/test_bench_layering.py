"""bench/ measures ops and layers; experiments/ builds on it. The reverse import would tie the
benchmarks to the experiment code (and made an import knot before), so it is checked here."""

import ast
from pathlib import Path

import routeformer.bench

BENCH = Path(routeformer.bench.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_bench_never_imports_experiments():
    offenders = {path.name: sorted(m for m in imported_modules(path)
                                   if m.startswith("routeformer.experiments"))
                 for path in sorted(BENCH.glob("*.py"))}
    assert {name: mods for name, mods in offenders.items() if mods} == {}
