"""The layer benchmark of `routeformer compare`: each mechanism's causal layer against `full` across T."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from routeformer.experiments.common import log

# The layer benchmark's budgets are fixed, as in the mechanisms' own benches: sparse where T is large.
BENCH_OPTIONS = {"local": {"window": 256}, "meta": {"window": 256}, "topk": {"topk": 64},
                 "mita": {"landmarks": 64, "topk": 64}}


def bench_layers(mechanisms: Sequence[str], lengths: Sequence[int], repeats: int,
                 progress: Callable[[str], None] = log) -> list[dict[str, Any]]:
    """Each mechanism's causal layer (D=256, 4 heads, B=1) at each T: median forward (inference)
    and forward + backward time, alternated in one process, and the peak memory of forward +
    backward; ratios against the `full` layer measured in the same rounds."""
    names = ["full", *[m for m in mechanisms if m != "full"]]
    rows = []
    for length in lengths:
        for row in _bench_length(names, length, repeats):
            progress(f"  bench T={length} {row['mechanism']}: forward {row['forward_ms']:.1f} ms "
                     f"(speed-up vs full {1 / row['forward_vs_full']:.2f}), "
                     f"fwd+bwd {row['fwd_bwd_ms']:.1f} ms "
                     f"(speed-up {1 / row['fwd_bwd_vs_full']:.2f}; full time / this time, > 1 faster)")
            if row["mechanism"] in mechanisms:
                rows.append(row)
    return rows


def _bench_length(names: Sequence[str], length: int, repeats: int) -> list[dict[str, Any]]:
    from routeformer.attention import build_attention
    from routeformer.bench.layer_calls import layer_forward, layer_forward_backward, layer_inputs
    from routeformer.bench.timing import median_times, peak_memory_mib

    layers = {m: build_attention(m, dim=256, heads=4, causal=True, **BENCH_OPTIONS.get(m, {})) for m in names}
    inputs = {m: layer_inputs(layers[m], length) for m in names}
    forward = {m: layer_forward(layers[m], *inputs[m]) for m in names}
    forward_backward = {m: layer_forward_backward(layers[m], *inputs[m]) for m in names}
    fwd = median_times(forward, repeats)
    fwd_bwd = median_times(forward_backward, repeats)
    return [{"T": length, "mechanism": m, "forward_ms": 1000 * fwd[m], "fwd_bwd_ms": 1000 * fwd_bwd[m],
             "forward_vs_full": fwd[m] / fwd["full"], "fwd_bwd_vs_full": fwd_bwd[m] / fwd_bwd["full"],
             "fwd_bwd_peak_mib": peak_memory_mib(forward_backward[m])} for m in names]
