"""Every op's naive twin (src/routeformer/ops/<op>/reference.py) is independent of the fast paths it
specifies: it imports torch and a short list of pure helpers, never a fast module, a kernel
(ops.native, ops.triton) or the backend switch (ops.backends) — imports inside functions included.
A helper a reference shares with its fast path is copied into it; the copied constants must still
equal the op's."""

import ast
from pathlib import Path

import routeformer

OPS = Path(routeformer.__file__).parent / "ops"
REQUIRED = {"full", "local", "linear", "topk", "mita", "expanding"}

# The only routeformer names a reference may import: argument checks, the slot count, the masked
# softmax of the full reference (itself a reference), and expanding attention's prior (pure math on
# torch: horizons, log decays, stopping rule; shared with the band path, while the C kernels compute
# it on their own). Each of these modules is checked to import nothing else from routeformer either.
ALLOWED = {
    "routeformer.ops._checks": {"check_positive", "check_qkv"},
    "routeformer.ops.expanding.prior": {
        "check_expanding_options", "check_prior", "geometric_horizon", "masked_logits",
        "mean_field_converged", "mean_field_horizon", "mean_field_log_decay", "prior_log_decay",
        "query_context", "softmax_rows", "stop_now",
    },
    "routeformer.ops.full.reference": {"allowed_keys", "masked_attention_reference"},
    "routeformer.ops.mita.checks": {"check_mita_args", "grid_pool_shape"},
    "routeformer.ops.topk.slots": {"check_routing", "routing_slots"},
}
# Third-party imports a reference may use.
THIRD_PARTY = {"__future__", "math", "torch", "torch.nn.functional"}


def references() -> list[Path]:
    return sorted(OPS.glob("*/reference.py"))


def module_path(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = OPS.parent / relative / "__init__.py"
    return package if package.exists() else (OPS.parent / relative).with_suffix(".py")


def forbidden_imports(path: Path) -> list[str]:
    """'module: names' for every import of the file outside ALLOWED and THIRD_PARTY."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module, names = node.module or "", {alias.name for alias in node.names}
            if node.level:  # a relative import names nothing checkable: not allowed
                found.append(f"{'.' * node.level}{module}: {sorted(names)}")
            elif module in ALLOWED:
                if not names <= ALLOWED[module]:
                    found.append(f"{module}: {sorted(names - ALLOWED[module])}")
            elif module not in THIRD_PARTY:
                found.append(f"{module}: {sorted(names)}")
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name not in THIRD_PARTY]
    return found


def test_there_is_a_reference_module_per_op():
    ops = {path.parent.name for path in references()}
    assert len(ops) >= 5 and REQUIRED <= ops, sorted(ops)


def test_references_import_only_pure_helpers():
    bad = {str(path.relative_to(OPS)): found for path in references() if (found := forbidden_imports(path))}
    assert bad == {}


def test_the_allowed_helpers_are_pure_themselves():
    """The helper modules import nothing from routeformer but other allowed helpers: no fast path
    reaches a reference through them."""
    bad = {module: found for module in ALLOWED if (found := forbidden_imports(module_path(module)))}
    assert bad == {}


def test_the_checker_catches_a_fast_import(tmp_path):
    source = tmp_path / "reference.py"
    source.write_text("\n".join([
        "import torch", "", "", "def f():",
        "    from routeformer.ops.local.op import in_window",
        "    from routeformer.ops.full.reference import masked_attention_reference",
        "    from routeformer.ops._checks import check_qkv",
        "    import routeformer.ops.backends", "",
    ]))
    assert forbidden_imports(source) == ["routeformer.ops.local.op: ['in_window']",
                                         "routeformer.ops.backends"]


def test_copied_constants_equal_the_ops():
    from routeformer.ops.linear import op as linear_op
    from routeformer.ops.linear import reference as linear_reference
    from routeformer.ops.mita import op as mita_op
    from routeformer.ops.mita import reference as mita_reference

    assert linear_reference.DEFAULT_EPS == linear_op.DEFAULT_EPS
    assert mita_reference.DEFAULT_BLOCK == mita_op.DEFAULT_BLOCK
