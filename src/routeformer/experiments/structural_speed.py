"""`routeformer reproduce structural-speed`: expanding attention timed against `local` with the same
mean window — its real competitor — rather than against full attention, by the bench suite's
`bench.structural_bench.time_against_local` (causal, fp32, B=1, H=4, d=64, one thread); full
causal SDPA is timed in the same rounds for reference only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from routeformer.bench.structural_bench import time_against_local
from routeformer.experiments.registry import register_experiment
from routeformer.runner.report import markdown_table, provenance, write_result

PRIORS = {"Beta(1, 9)": (1.0, 9.0), "Beta(1, 99)": (1.0, 99.0)}


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
        "alternating within a round (the order reversed every other round); ratios are medians of "
        "per-round ratios (> 1: expanding is slower). "
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
