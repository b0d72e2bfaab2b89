"""`routeformer bench compile`: every mechanism under `torch.compile` — graph breaks, compile time,
and the speedup over eager, forward (inference) and forward + backward, in one process.

Graph breaks come from `torch._dynamo.explain` on the layer's forward. A break splits the hot path
into several compiled graphs with Python in between; data-dependent shapes (how many rows an expert
gets, how many meta-tokens a sequence holds) are the usual cause.

Compile times are cold: inductor's and AOT autograd's on-disk caches are switched off while a layer
is benchmarked (`force_disable_caches`), so a second run of the command reports the same cost a
user's first run pays, not a cache hit.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from routeformer.bench.timing import medians, ratio_quartiles, round_times

HEADER = ("| mechanism | graphs | breaks | compile s | forward eager ms | compiled ms | speedup | "
          "fwd+bwd eager ms | compiled ms | speedup | per-round speedup, quartiles | first break |\n|"
          + "---|" * 12)


def graph_breaks(layer: torch.nn.Module, x: torch.Tensor, extra: dict[str, Any]) -> dict[str, Any]:
    """Graphs, breaks and the first break's reason of one forward call, traced by dynamo."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(x, **extra)
    reasons = [str(getattr(reason, "reason", reason)).splitlines()[0] for reason in explanation.break_reasons]
    return {"graphs": explanation.graph_count, "breaks": explanation.graph_break_count,
            "first_break": reasons[0] if reasons else ""}


def bench_compile(
    mechanisms: Sequence[str], length: int = 1024, repeats: int = 5, dim: int = 256, heads: int = 4,
    options: dict[str, dict[str, Any]] | None = None, progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per mechanism (causal layer, B=1, `length` tokens); see the module docstring."""
    import logging

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # breaks are reported in the table
    # Switching the caches off also switches off dynamo's profile-guided recompilation, which warns.
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    rows = []
    for mechanism in mechanisms:
        with torch._inductor.config.patch(force_disable_caches=True):  # cold compile times
            rows.append(_bench_one(mechanism, length, repeats, dim, heads,
                                   (options or {}).get(mechanism, {})))
        progress(format_row(rows[-1]))
    torch._dynamo.reset()
    return rows


def _bench_one(mechanism: str, length: int, repeats: int, dim: int, heads: int,
               options: dict[str, Any]) -> dict[str, Any]:
    from routeformer.attention import build_attention
    from routeformer.bench.layer_calls import layer_forward, layer_forward_backward, layer_inputs

    layer = build_attention(mechanism, dim=dim, heads=heads, causal=True, **options)
    x, extra = layer_inputs(layer, length)
    row: dict[str, Any] = {"mechanism": mechanism, "T": length, **graph_breaks(layer.eval(), x, extra)}
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    try:
        began = time.perf_counter()
        layer_forward(compiled, x, extra)()
        layer_forward_backward(compiled, x, extra)()
        row["compile_s"] = time.perf_counter() - began
        fwd = medians(round_times({"eager": layer_forward(layer, x, extra),
                                    "compiled": layer_forward(compiled, x, extra)}, repeats))
        rounds = round_times({"eager": layer_forward_backward(layer, x, extra),
                              "compiled": layer_forward_backward(compiled, x, extra)}, repeats)
        both = medians(rounds)
    except Exception as error:  # noqa: BLE001 - a mechanism that fails to compile is a result to report
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return row
    row.update(forward_eager_ms=1000 * fwd["eager"], forward_compiled_ms=1000 * fwd["compiled"],
               forward_speedup=fwd["eager"] / fwd["compiled"], fwd_bwd_eager_ms=1000 * both["eager"],
               fwd_bwd_compiled_ms=1000 * both["compiled"],
               fwd_bwd_speedup=both["eager"] / both["compiled"],
               # speed-up of each round (eager / compiled, run back to back): robust to drift
               fwd_bwd_round_quartiles=ratio_quartiles(rounds["eager"], rounds["compiled"]))
    return row


def format_row(row: dict[str, Any]) -> str:
    head = f"| {row['mechanism']} | {row['graphs']} | {row['breaks']} | "
    if "error" in row:
        return head + f"failed: {row['error']} |" + " |" * 7 + f" {row['first_break'][:120]} |"
    return head + " | ".join([
        f"{row['compile_s']:.1f}", f"{row['forward_eager_ms']:.2f}", f"{row['forward_compiled_ms']:.2f}",
        f"{row['forward_speedup']:.2f}x", f"{row['fwd_bwd_eager_ms']:.2f}",
        f"{row['fwd_bwd_compiled_ms']:.2f}", f"{row['fwd_bwd_speedup']:.2f}x",
        "{1:.3f} ({0:.3f}-{2:.3f})".format(*row["fwd_bwd_round_quartiles"]),
        row["first_break"][:120]]) + " |"
