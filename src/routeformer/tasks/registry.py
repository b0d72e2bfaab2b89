"""Tasks by name: `register_task`, `build_task`, `list_tasks` (the attention registry's twin)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_REGISTRY: dict[str, type] = {}


def register_task(name: str) -> Callable[[type], type]:
    """Class decorator: make the task buildable as `build_task(name, **options)`."""

    def decorate(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"task name {name!r} is already registered by {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        return cls

    return decorate


def task_options(name: str) -> dict[str, Any]:
    """The options of task `name` with their defaults (its constructor's keyword arguments)."""
    parameters = inspect.signature(_get(name).__init__).parameters.values()
    return {p.name: (None if p.default is inspect.Parameter.empty else p.default)
            for p in parameters if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}


def list_tasks() -> dict[str, dict[str, Any]]:
    """Every registered task and its options (with defaults), sorted by name."""
    _load_builtin_tasks()
    return {name: task_options(name) for name in sorted(_REGISTRY)}


def build_task(name: str, **options: Any):
    """Build the task registered as `name`; unknown names or options raise ValueError."""
    valid = task_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {name!r}; valid options: {sorted(valid)}")
    return _get(name)(**options)


def _get(name: str) -> type:
    _load_builtin_tasks()
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def _load_builtin_tasks() -> None:
    import routeformer.tasks  # noqa: F401  (importing the package registers the built-in tasks)
