"""ops/ and attention/ import no private name of another module, and their modules form no import
cycle (counting imports inside functions too: a lazy import is still a dependency); nor does the
whole package, but for a registry's plugin imports."""

import ast
from pathlib import Path

import routeformer

SRC = Path(routeformer.__file__).parent
PACKAGES = ("ops", "attention")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names imported from it) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("routeformer"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("routeformer")]
    return found


def sources(packages=PACKAGES):
    return [path for package in packages for path in sorted((SRC / package).rglob("*.py"))]


def test_no_private_names_cross_modules():
    crossing = [f"{module_name(path)}: from {module} import {name}" for path in sources()
                for module, names in imports_of(path) for name in names
                if name.startswith("_") and not name.startswith("__")]
    assert crossing == []


def import_cycles(paths) -> list[list[str]]:
    modules = {module_name(path): path for path in paths}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for module, names in imports_of(path):
            for target in [f"{module}.{n}" for n in names] + [module]:
                if target in modules and target != name:
                    edges.add(target)
                    break
        graph[name] = edges
    # A package's __init__ importing its own submodules is not a cycle with them when they import
    # the package's names: count only the direction submodule -> package for those pairs.
    for name in graph:
        graph[name] = {t for t in graph[name] if not (t.startswith(name + "."))}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_cycles():
    assert import_cycles(sources()) == []


def test_no_import_cycles_in_the_package_but_registry_plugins():
    """Across all of src/routeformer the only cycles allowed are a registry's plugin imports (the
    registry imports its plugins so that listing them registers them; each plugin imports the
    registry to register itself)."""
    cycles = import_cycles(sorted(SRC.rglob("*.py")))
    assert [c for c in cycles if not any(m.rsplit(".", 1)[-1] == "registry" for m in c)] == []
