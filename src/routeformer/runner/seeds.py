"""The order in which an experiment visits its seeds, in one place.

Every multi-seed experiment runs the same thing once per seed, or a set of variants once per
(variant, seed). The order matters: cached runs are stored under keys in that order (an
interrupted sweep leaves a prefix done), and code that draws from a global RNG between runs gives
different numbers in another order. These functions state the order once:

- `over_seeds(fn, seeds)`: `[fn(seed) for seed in seeds]`, seeds in the given order.
- `seed_grid(variants, seeds, seed_major=True)`: every (variant, seed) pair; seed-major (all
  variants of the first seed, then of the next) or variant-major (all seeds of the first variant,
  then of the next), each in the given order.
- `seed_sweep(variants, seeds_of, seed_major=True)`: the same when each variant has its own seeds.

Seeds are ints (not bools), each at most once; variants are compared with `==` (they need not be
hashable) and each appears at most once. A repeat is a ValueError: it would train (or read from the
cache) the same run twice under one key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
V = TypeVar("V")


def checked_seeds(seeds: Iterable[int], name: str = "seeds") -> tuple[int, ...]:
    """`seeds` as a tuple, in the given order (empty allowed).

    Raises TypeError if `seeds` is not an iterable of ints (a bool is not a seed) and ValueError
    if a seed repeats; `name` names the argument in the message."""
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Iterable):
        raise TypeError(f"{name} must be an iterable of ints, got {type(seeds).__name__}")
    checked = tuple(seeds)
    for seed in checked:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{name} must hold ints, got {seed!r} ({type(seed).__name__})")
    repeated = sorted({seed for i, seed in enumerate(checked) if seed in checked[:i]})
    if repeated:
        raise ValueError(f"{name} must not repeat a seed; repeated: {repeated}")
    return checked


def _checked_variants(variants: Iterable[V]) -> list[V]:
    if isinstance(variants, (str, bytes)) or not isinstance(variants, Iterable):
        raise TypeError(f"variants must be an iterable, got {type(variants).__name__}")
    checked = list(variants)
    repeated = [variant for i, variant in enumerate(checked) if variant in checked[:i]]
    if repeated:
        raise ValueError(f"variants must not repeat; repeated: {repeated!r}")
    return checked


def over_seeds(fn: Callable[[int], T], seeds: Iterable[int]) -> list[T]:
    """`[fn(seed) for seed in seeds]`: fn called once per seed, in the order of `seeds`.

    An empty `seeds` gives `[]` (fn is not called). Raises TypeError/ValueError as
    `checked_seeds` (before any call of fn)."""
    return [fn(seed) for seed in checked_seeds(seeds)]


def seed_grid(variants: Iterable[V], seeds: Iterable[int], seed_major: bool = True) -> list[tuple[V, int]]:
    """Every (variant, seed) pair, once, in a fixed order.

    seed_major=True (the default): for each seed in the order of `seeds`, every variant in the
    order of `variants` (a run cut short leaves whole seeds done); False: for each variant, every
    seed. Either empty gives `[]`. Raises ValueError if a variant (by `==`) or a seed repeats,
    TypeError as `checked_seeds` or if `variants` is not an iterable (a string is not one)."""
    checked = checked_seeds(seeds)
    kinds = _checked_variants(variants)
    if seed_major:
        return [(variant, seed) for seed in checked for variant in kinds]
    return [(variant, seed) for variant in kinds for seed in checked]


def seed_sweep(variants: Iterable[V], seeds_of: Callable[[V], Iterable[int]],
               seed_major: bool = True) -> list[tuple[V, int]]:
    """Every (variant, seed) pair with seed in `seeds_of(variant)`, once, in a fixed order.

    seed_major=True (the default): the seeds of all variants in ascending order, and for each the
    variants that have it, in the order of `variants`; False: for each variant in order, its seeds
    in the order `seeds_of` gives them. `seeds_of` is called once per variant, in order. Raises
    ValueError if a variant (by `==`) repeats or a variant's seeds repeat, TypeError as
    `seed_grid`."""
    kinds = _checked_variants(variants)
    own = [checked_seeds(seeds_of(variant), f"seeds_of({variant!r})") for variant in kinds]
    if not seed_major:
        return [(variant, seed) for variant, seeds in zip(kinds, own, strict=True) for seed in seeds]
    every = sorted({seed for seeds in own for seed in seeds})
    return [(variant, seed) for seed in every
            for variant, seeds in zip(kinds, own, strict=True) if seed in seeds]
