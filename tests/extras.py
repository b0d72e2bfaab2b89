"""Optional extras in tests: a test that needs one imports it through `require`, so that it skips
where the extra cannot import — not installed, or installed beside core releases it does not
support (transformers on safetensors 0.4, scikit-learn on numpy 1.24: the oldest-core-deps leg of
`.ci/run`) — instead of failing for a reason that is not the code's."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or skip the calling test naming `extra` and why it did not import.

    Args:
        module: dotted module name, e.g. ``"routeformer.integrations.hf"``.
        extra: the pyproject extra that brings it, e.g. ``"hf"``.

    Returns:
        The imported module.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:  # ModuleNotFoundError, or a dependency's version check
        pytest.skip(f"{module} does not import (the {extra} extra): {error}", allow_module_level=True)
