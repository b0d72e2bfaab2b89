"""The statistics compare's reports share: when two results count as different (more than 3 sd
apart), and the Pareto front of quality against a cost."""

from __future__ import annotations

SEPARATION_SDS = 3.0


def separated(a: tuple[float, float], b: tuple[float, float], sds: float = SEPARATION_SDS) -> bool:
    """Whether two (mean, sd) results differ by more than `sds` times the larger sd. (Callers ask
    for at least two seeds: a single seed's sd of 0 would separate everything.)"""
    (mean_a, sd_a), (mean_b, sd_b) = a, b
    return abs(mean_a - mean_b) > sds * max(sd_a, sd_b)


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
