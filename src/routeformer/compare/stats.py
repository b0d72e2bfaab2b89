"""The statistics compare's reports share: when two results count as different (more than 3 sd
apart), a task's best floor and whether a mechanism beats it, the paired difference from a
baseline over seeds (every mechanism saw the same batches per seed), and the Pareto front of
quality against a cost."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from routeformer.runner.report import mean_sd

SEPARATION_SDS = 3.0


def separated(a: tuple[float, float], b: tuple[float, float], sds: float = SEPARATION_SDS) -> bool:
    """Whether two (mean, sd) results differ by more than `sds` times the larger sd. (Callers ask
    for at least two seeds: a single seed's sd of 0 would separate everything.)"""
    (mean_a, sd_a), (mean_b, sd_b) = a, b
    return abs(mean_a - mean_b) > sds * max(sd_a, sd_b)


def best_floor(floor: Mapping[str, Any]) -> float:
    """The best of a task floor's chance level and shortcut baselines: the highest where
    `floor["higher_is_better"]`, else the lowest. `floor` holds `chance` (a number), `baselines`
    (name -> number) and `higher_is_better`; a floor missing one raises ValueError."""
    missing = [key for key in ("chance", "baselines", "higher_is_better") if key not in floor]
    if missing:
        raise ValueError(f"floor must hold chance, baselines and higher_is_better; missing {missing}")
    return (max if floor["higher_is_better"] else min)([floor["chance"], *floor["baselines"].values()])


def beats_floor(values: Sequence[float], floor_value: float, higher_is_better: bool) -> bool:
    """Whether the mean of `values` (one per seed) is on the better side of `floor_value` and
    separated from it by more than SEPARATION_SDS sd of the values. Never with fewer than two values:
    one seed has no spread to judge by."""
    if len(values) < 2:
        return False
    mean, sd = mean_sd(list(values))
    return separated((mean, sd), (floor_value, 0.0)) and (
        mean > floor_value if higher_is_better else mean < floor_value)


def paired_differences(values: Iterable[tuple[Hashable, float]], baseline: Mapping[Hashable, float]
                       ) -> list[float]:
    """value - baseline[seed] for every (seed, value) of `values` whose seed `baseline` holds, in
    the order of `values` (a seed the baseline lacks is left out)."""
    return [value - baseline[seed] for seed, value in values if seed in baseline]


def paired_delta(values: Iterable[tuple[Hashable, float]], baseline: Mapping[Hashable, float]
                 ) -> tuple[float, float]:
    """Mean and sd (runner.report.mean_sd) over seeds of the paired differences
    (`paired_differences`); (nan, nan) when no seed is shared."""
    deltas = paired_differences(values, baseline)
    return mean_sd(deltas) if deltas else (float("nan"), float("nan"))


def delta_separated(mean: float, sd: float, seeds: int, sds: float = SEPARATION_SDS) -> bool:
    """Whether a paired difference of `mean` ± `sd` over `seeds` seeds is beyond `sds` sd of zero;
    never with fewer than two seeds. A NaN mean or sd is never separated."""
    return seeds > 1 and abs(mean) > sds * sd


def pareto_front(points: dict[str, tuple[float, float]], higher_is_better: bool) -> set[str]:
    """Names not dominated by another point with fewer (or equal) FLOPs and better (or equal)
    quality, one of them strictly. points: name -> (flops, quality)."""
    def better_or_equal(a: float, b: float) -> bool:
        return a >= b if higher_is_better else a <= b

    front = set()
    for name, (flops, quality) in points.items():
        dominated = any(
            other != name and f <= flops and better_or_equal(q, quality) and (f < flops or q != quality)
            for other, (f, q) in points.items())
        if not dominated:
            front.add(name)
    return front
