"""`routeformer reproduce structural-speed`: expanding attention timed against `local` with the same
mean window — its real competitor — rather than against full attention.

Expanding attention reads, per query, the keys within its inferred horizon. A sliding window that
reads as many keys on average (window = the mean final horizon, rounded) does the same amount of
attention work without any inference; the question is what the inference costs on top. Full
causal SDPA is timed in the same rounds for reference only.

Method: causal, fp32, B=1, H=4, d=64, random q, k, v seeded by the length; one thread (the machine
is shared, see the report's load line); for each length and prior, the ops run in alternation
(expanding, local, SDPA, expanding, ...) for `repeats` rounds after two warm-up rounds; we report
the median of the per-round ratios expanding / local (a noisy neighbour slows a whole round, so a
round's ratio is steadier than a ratio of medians) and the medians of the times.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from routeformer.experiments.registry import register_experiment
from routeformer.experiments.report import markdown_table, provenance, write_result
from routeformer.ops import expanding_attention, multihop_attention
from routeformer.ops.local import local_attention

PRIORS = {"Beta(1, 9)": (1.0, 9.0), "Beta(1, 99)": (1.0, 99.0)}
# Full attention (and multihop) is timed for reference up to this length only: at T = 16384 a causal
# SDPA forward+backward takes seconds on one thread, and the comparison here is with local.
SDPA_UP_TO = 4096


def _forward(op, inputs):
    def run():
        with torch.no_grad():
            op(*inputs)
    return run


def _forward_backward(op, leaves):
    def run():
        op(*leaves).sum().backward()
        for leaf in leaves:
            leaf.grad = None
    return run


def alternating_rounds(fns: dict[str, Any], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each callable per round, the callables alternating within a round (`warmup`
    rounds discarded)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(repeats + warmup):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def time_against_local(length: int, alpha: float, beta: float, *, repeats: int, heads: int = 4,
                       head_dim: int = 64, with_multihop: bool = False) -> dict[str, Any]:
    """Mean final window of expanding at this prior, and expanding / local(same mean window) / SDPA
    times, forward and forward+backward (and multihop's, two hops, with `with_multihop`)."""
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
    if with_multihop and length <= SDPA_UP_TO:
        ops["multihop"] = lambda q, k, v: multihop_attention(q, k, v, hops=2, causal=True)
    record: dict[str, Any] = {"length": length, "prior": [alpha, beta], "mean_window": window,
                              "max_window": int(result.horizon.max()),
                              "iterations_mean": float(result.iterations.float().mean())}
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    modes = (("forward", _forward, (q, k, v)), ("forward+backward", _forward_backward, leaves))
    for mode, wrap, inputs in modes:
        times = alternating_rounds({name: wrap(op, inputs) for name, op in ops.items()}, repeats)
        ratios = [e / loc for e, loc in zip(times["expanding"], times["local"], strict=True)]
        record[mode] = {
            "median_seconds": {name: statistics.median(values) for name, values in times.items()},
            "expanding_over_local_per_round": ratios,
            "expanding_over_local_median": statistics.median(ratios),
        }
        if "sdpa" in times:
            record[mode]["expanding_over_sdpa_median"] = statistics.median(
                e / s for e, s in zip(times["expanding"], times["sdpa"], strict=True))
        if "multihop" in times:
            record[mode]["multihop_over_sdpa_median"] = statistics.median(
                m / s for m, s in zip(times["multihop"], times["sdpa"], strict=True))
    return record


@register_experiment("structural-speed", "expanding attention timed against local attention with the same "
                     "mean window (alternating repetitions, one thread)")
def speed(out_dir: Path, quick: bool) -> Path:
    lengths = [256] if quick else [1024, 4096, 16384]
    repeats = 2 if quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    try:
        # multihop (two SDPA-like passes) is timed beside SDPA in the first prior's rounds only.
        records = [time_against_local(length, alpha, beta, repeats=repeats, with_multihop=index == 0)
                   for length in lengths for index, (alpha, beta) in enumerate(PRIORS.values())]
    finally:
        torch.set_num_threads(threads)
    load_after = os.getloadavg()
    rows = []

    def milliseconds(mode: dict[str, Any]) -> str:
        return " / ".join(f"{mode['median_seconds'][name] * 1e3:.1f}" for name in ("expanding", "local"))

    for record in records:
        fwd, both = record["forward"], record["forward+backward"]
        rows.append([record["length"], f"Beta({record['prior'][0]:g}, {record['prior'][1]:g})",
                     record["mean_window"], record["max_window"], f"{record['iterations_mean']:.2f}",
                     milliseconds(fwd),
                     f"**{fwd['expanding_over_local_median']:.2f}x**",
                     milliseconds(both),
                     f"**{both['expanding_over_local_median']:.2f}x**",
                     f"{fwd['expanding_over_sdpa_median']:.2f}x / {both['expanding_over_sdpa_median']:.2f}x"
                     if "expanding_over_sdpa_median" in fwd else "not timed"])
    headers = ["T", "prior", "mean window (local's window)", "max window", "mean iterations",
               "fwd ms: expanding / local", "fwd: expanding time / local time",
               "fwd+bwd ms: expanding / local", "fwd+bwd: expanding time / local time",
               "expanding time / SDPA time (fwd / fwd+bwd)"]
    markdown = "\n\n".join([
        "# structural-speed: expanding attention against local attention with the same mean window",
        provenance(f"routeformer reproduce structural-speed{' --quick' if quick else ''}") + " Timed with "
        "1 thread.",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{', '.join(f'{x:.2f}' for x in load_after)}. **The machine was shared with other jobs while "
        "this ran: absolute times are not reliable; the ratios come from alternating repetitions in one "
        "process.**",
        f"Causal, fp32, B=1, H=4, d=64; random q, k, v. {repeats} rounds after two warm-up rounds, ops "
        "alternating within a round; ratios are medians of per-round ratios (> 1: expanding is slower). "
        "local's window is expanding's mean final window at that prior on the same inputs, so both read "
        "the same number of keys on average.",
        markdown_table(headers, rows),
        "multihop (two hops, P V + P (P V)), timed in the Beta(1, 9) rounds: time / SDPA time (fwd, "
        "fwd+bwd): " + "; ".join(
            f"T={r['length']}: {r['forward']['multihop_over_sdpa_median']:.2f}x, "
            f"{r['forward+backward']['multihop_over_sdpa_median']:.2f}x" for r in records
            if "multihop_over_sdpa_median" in r["forward"]) + ".",
    ])
    result = {"repeats": repeats, "load_before": load_before, "load_after": load_after, "records": records}
    return write_result(out_dir, result, markdown)
