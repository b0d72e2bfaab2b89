"""The switches that steer the ops' backends, with no logic of their own: the lowest layer of the
dispatch, imported by the native loader and by `ops.backends` (which decides; see its docstring).

- `ROUTEFORMER_NATIVE=0` and `native_enabled(False)`: the C kernels are not used.
- `ROUTEFORMER_TRITON=0`: the Triton kernels are not used (a switch for measuring the PyTorch
  path on a GPU). Both variables are read at each call.
- the forced backend (`ops.backends.force_backend`, validated there): "torch" turns both kernel
  families off, "native" turns the C kernels on whatever `ROUTEFORMER_NATIVE` and `native_enabled`
  say, "triton" sends every op with a Triton kernel to it whatever the device (CPU tensors run in
  Triton's interpreter) and leaves the other ops on their usual paths. `ROUTEFORMER_TRITON=0`
  still wins over a forced "triton": it is the switch benchmarks use to time the PyTorch path on
  a GPU, and the Triton tests rely on it staying off inside `force_triton()`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token

BACKENDS = ("triton", "native", "torch")

_FORCED: ContextVar[str | None] = ContextVar("routeformer_forced_backend", default=None)
_NATIVE_ENABLED: ContextVar[bool] = ContextVar("routeformer_native_enabled", default=True)


def forced_backend() -> str | None:
    """The backend forced for this context (one of BACKENDS), or None: each op decides."""
    return _FORCED.get()


def set_forced_backend(name: str | None) -> Token:
    """Force `name` (already validated) until `reset_forced_backend(token)`."""
    return _FORCED.set(name)


def reset_forced_backend(token: Token) -> None:
    _FORCED.reset(token)


@contextmanager
def native_enabled(enabled: bool) -> Iterator[None]:
    """Within the block, the ops use the native kernels (when they can) or never use them; e.g. to
    time the PyTorch path beside the native one."""
    token = _NATIVE_ENABLED.set(enabled)
    try:
        yield
    finally:
        _NATIVE_ENABLED.reset(token)


def native_switched_on() -> bool:
    """Whether the switches let the C kernels run (whether they can is the loader's question)."""
    forced = _FORCED.get()
    if forced in ("native", "torch"):
        return forced == "native"
    # Forcing "triton" leaves the ops without a Triton kernel on their usual paths.
    return _NATIVE_ENABLED.get() and os.environ.get("ROUTEFORMER_NATIVE", "1") != "0"


def triton_switched_on() -> bool:
    """Whether the switches let the Triton kernels run (`ROUTEFORMER_TRITON`, the forced backend)."""
    return _FORCED.get() not in ("native", "torch") and os.environ.get("ROUTEFORMER_TRITON", "1") != "0"
