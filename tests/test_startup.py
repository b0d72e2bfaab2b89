"""`import routeformer` and the command's start-up leave torch.compile's machinery unloaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"


def loaded_modules(code: str) -> set[str]:
    """Modules in sys.modules after running `code` in a fresh interpreter with this tree's source."""
    environment = {**os.environ, "PYTHONPATH": f"{SOURCE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=environment, check=True, timeout=300)
    return set(result.stdout.split())


def test_import_leaves_dynamo_and_inductor_unloaded():
    modules = loaded_modules("import routeformer")
    assert "routeformer.attention" in modules
    assert "torch._dynamo" not in modules
    assert "torch._inductor" not in modules


def test_help_leaves_dynamo_unloaded():
    code = ("import contextlib, io, sys\nsys.argv = ['routeformer', '--help']\n"
            "from routeformer.cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    main()")
    modules = loaded_modules(code)
    assert "routeformer.cli" in modules
    assert "torch._dynamo" not in modules
