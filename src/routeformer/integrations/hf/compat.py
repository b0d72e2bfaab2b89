"""The transformers releases this integration is tested with, and the one place that reads the cache
argument transformers passes.

Why this module exists: transformers 5.24 renamed the cache argument of every model and attention
`forward` from `past_key_values` to `cache` (the old name is still accepted by transformers' own
modules, with a deprecation warning, until 5.40). A routeformer attention module that only read
`past_key_values` then saw no cache at all: each decode step attended to its one new token alone,
and `generate(use_cache=True)` continued differently from `use_cache=False`, without an error.

Two guards keep such drift from being silent again:
- `passed_cache` takes the cache under either name, and raises when a `Cache` arrives under any
  other argument (a future rename fails loudly instead of being ignored);
- `untested_reason` names a transformers release outside `TESTED_RANGE`; cached generation then
  refuses with one line (uncached generation still works), since a release we never ran may pass
  or expect the cache in a way we cannot see. `tests/integrations` runs on the oldest and the
  newest release of the range (`.ci/run`), so the range is what was tested.
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers.cache_utils import Cache

# [oldest tested, first untested): keep equal to the `hf`/`test` extras in pyproject.toml and the
# oldest pin in .ci/run (tests/integrations/test_hf_versions.py checks that they agree).
TESTED_RANGE = ("5.20.0", "5.25.0")


def _release(version: str) -> tuple[int, ...]:
    """'5.24.0' -> (5, 24, 0); pre-release and local suffixes ('5.25.0.dev0', '5.24.0+cpu') are cut
    at the first non-numeric part, so a 5.25 pre-release counts as 5.25 (untested)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def untested_reason(version: str | None = None) -> str | None:
    """Why cached generation is refused under transformers `version` (default: the installed one),
    or None when the version lies in TESTED_RANGE."""
    version = transformers.__version__ if version is None else version
    low, high = TESTED_RANGE
    if _release(low) <= _release(version) < _release(high):
        return None
    return (f"transformers {version} is outside the range routeformer's cached generation is tested "
            f"with (>={low},<{high}); a cache it passes differently would give a silently wrong "
            "continuation")


def passed_cache(args: tuple, kwargs: dict[str, Any], past_key_values: Any = None, cache: Any = None) -> Any:
    """The transformers cache a forward call received (under `cache`, transformers >= 5.24, or
    `past_key_values`, earlier), or None. A `Cache` under any other argument, positional or named,
    raises: transformers changed how it hands over the cache and routeformer would not see it."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("both cache and past_key_values were passed; pass one "
                         "(cache in transformers >= 5.24)")
    found = cache if cache is not None else past_key_values
    stray = [f"argument {name!r}" for name, value in kwargs.items() if isinstance(value, Cache)]
    stray += [f"positional argument {index}" for index, value in enumerate(args) if isinstance(value, Cache)]
    if stray:
        raise ValueError(f"transformers {transformers.__version__} passed a Cache as {', '.join(stray)}, "
                         "not as cache/past_key_values; routeformer cannot tell how to continue it. "
                         "Pass use_cache=False, or install a transformers release in the tested range "
                         f"(>={TESTED_RANGE[0]},<{TESTED_RANGE[1]})")
    return found


def refuse_untested_cache(cache: Any) -> None:
    """Raise the one-line refusal when a cache is used under an untested transformers release."""
    if cache is None:
        return
    reason = untested_reason()
    if reason is not None:
        raise ValueError(f"cached generation refused: {reason}; pass use_cache=False")
