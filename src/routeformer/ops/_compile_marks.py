"""torch.compile markers that do not import torch._dynamo when a module is imported.

`torch.compiler.assume_constant_result` and `torch.compiler.disable` import dynamo (seconds of
start-up) the moment they decorate a function. These apply the same markers on use: dynamo is
imported by whoever calls `torch.compile`, before any function here is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

Function = TypeVar("Function", bound=Callable[..., Any])


def assume_constant_result(function: Function) -> Function:
    """Mark `function` as `torch.compiler.assume_constant_result` does (dynamo traces a call as
    the constant it returns at trace time), without importing dynamo."""
    function._dynamo_marked_constant = True  # the attribute torch._dynamo's decorator sets
    return function


_DISABLED: dict[Callable[..., Any], Callable[..., Any]] = {}


def _disabled(function: Callable[..., Any]) -> Callable[..., Any]:
    disabled = _DISABLED.get(function)
    if disabled is None:
        disabled = _DISABLED[function] = torch.compiler.disable(function)
    return disabled


def disable_in_graphs(function: Function) -> Function:
    """`torch.compiler.disable` applied on use: a call inside a graph being traced runs `function`
    eagerly behind one graph break; an eager call runs it directly."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _disabled(function)(*args, **kwargs)
        return function(*args, **kwargs)

    return call  # type: ignore[return-value]
