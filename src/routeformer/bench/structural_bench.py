"""`routeformer bench structural`: the multihop and expanding ops against SDPA.

multihop runs two hops (P V + P (P V)). expanding's cost depends on the windows its inference
settles on, so it is timed at two priors — Beta(1, 9) (starting window 44) and Beta(1, 99)
(starting window 459) — on random q, k, v, and `expanding_windows` reports the mean final window
each one reached at every length. Causal, fp32.

`time_against_local` times expanding against its real competitor, `local` attention with the same
mean window (a sliding window reading as many keys on average does the same attention work without
any inference), with SDPA for reference; `routeformer reproduce structural-speed` reports it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from routeformer.bench.ops_bench import forward_backward_call, forward_call
from routeformer.bench.timing import round_times
from routeformer.ops import expanding_attention, multihop_attention
from routeformer.ops.local import local_attention

EXPANDING_PRIORS = {"expanding(Beta(1,9))": (1.0, 9.0), "expanding(Beta(1,99))": (1.0, 99.0)}
# Full attention (and multihop) is timed against local for reference up to this length only: at
# T = 16384 a causal SDPA forward+backward takes seconds on one thread.
SDPA_UP_TO = 4096


def _prior(heads: int, alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((heads,), alpha), torch.full((heads,), beta)


def structural_op_table(heads: int) -> Callable[[int], dict[str, Callable]]:
    def table(length: int) -> dict[str, Callable]:
        ops = {
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "multihop(hops=2)": lambda q, k, v: multihop_attention(q, k, v, hops=2, causal=True),
        }
        for name, (alpha, beta) in EXPANDING_PRIORS.items():
            prior = _prior(heads, alpha, beta)
            ops[name] = lambda q, k, v, prior=prior: expanding_attention(q, k, v, *prior).out
        return ops
    return table


def expanding_windows(
    lengths: list[int], *, batch: int = 1, heads: int = 4, head_dim: int = 64
) -> list[dict]:
    """Mean/max final window, mean iterations and scored pairs vs causal SDPA's, per prior and length,
    on the same random inputs `bench_ops` draws (seeded by the length)."""
    records = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen) for _ in range(3))
        for name, (alpha, beta) in EXPANDING_PRIORS.items():
            with torch.no_grad():
                result = expanding_attention(q, k, v, *_prior(heads, alpha, beta))
            window = result.horizon.float()
            records.append({
                "length": length, "impl": name, "window_mean": float(window.mean()),
                "window_max": float(window.max()), "window_mean_over_T": float(window.mean()) / length,
                "iterations_mean": float(result.iterations.float().mean()),
                "score_pairs_vs_full": result.scored_pairs / (batch * heads * length * (length + 1) / 2),
            })
    return records


WINDOW_HEADER = ("| T | impl | mean window | max window | mean window / T | mean iterations | "
                 "scored pairs vs causal SDPA |\n|---|---|---|---|---|---|---|")


def format_window_row(record: dict) -> str:
    return (f"| {record['length']} | {record['impl']} | {record['window_mean']:.1f} | "
            f"{record['window_max']:.0f} | {record['window_mean_over_T']:.4f} | "
            f"{record['iterations_mean']:.2f} | {record['score_pairs_vs_full']:.4f} |")


def time_against_local(length: int, alpha: float, beta: float, *, repeats: int, heads: int = 4,
                       head_dim: int = 64, with_multihop: bool = False) -> dict[str, Any]:
    """Mean final window of expanding at this prior, and expanding / local(same mean window) / SDPA
    times, forward and forward+backward (and multihop's, two hops, with `with_multihop`): `repeats`
    alternating rounds after two warm-up rounds, the median of the per-round ratios expanding /
    local (a noisy neighbour slows a whole round, so a round's ratio is steadier than a ratio of
    medians) and the medians of the times. Random q, k, v seeded by the length."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=gen) for _ in range(3))
    prior = (torch.full((heads,), alpha), torch.full((heads,), beta))
    with torch.no_grad():
        result = expanding_attention(q, k, v, *prior)
    window = max(1, round(float(result.horizon.float().mean())))
    ops = {
        "expanding": lambda q, k, v: expanding_attention(q, k, v, *prior).out,
        "local": lambda q, k, v: local_attention(q, k, v, window=window, causal=True),
    }
    if length <= SDPA_UP_TO:
        ops["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    timed_multihop = with_multihop and length <= SDPA_UP_TO
    if timed_multihop:
        ops["multihop"] = lambda q, k, v: multihop_attention(q, k, v, hops=2, causal=True)
    record: dict[str, Any] = {"length": length, "prior": [alpha, beta], "mean_window": window,
                              "max_window": int(result.horizon.max()),
                              "iterations_mean": float(result.iterations.float().mean())}
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    modes = (("forward", forward_call, (q, k, v)), ("forward+backward", forward_backward_call, leaves))
    for mode, wrap, inputs in modes:
        times = round_times({name: wrap(op, inputs) for name, op in ops.items()}, repeats, warmup=2)
        ratios = [e / loc for e, loc in zip(times["expanding"], times["local"], strict=True)]
        record[mode] = {
            "median_seconds": {name: statistics.median(values) for name, values in times.items()},
            "expanding_over_local_per_round": ratios,
            "expanding_over_local_median": statistics.median(ratios),
        }
        if "sdpa" in times:
            record[mode]["expanding_over_sdpa_median"] = statistics.median(
                e / s for e, s in zip(times["expanding"], times["sdpa"], strict=True))
        if timed_multihop:
            record[mode]["multihop_over_sdpa_median"] = statistics.median(
                m / s for m, s in zip(times["multihop"], times["sdpa"], strict=True))
    return record
