"""`routeformer bench layers`: whole causal layers (projections included) against the `full` layer.

The op benchmarks (`bench ops`) time the attention alone; a user swaps a whole layer, whose Q/K/V
and output projections cost the same for every mechanism and dilute the op's speed-up.
`routeformer compare` runs this benchmark after its training runs; `bench layers` runs it alone:
D=256, 4 heads, B=1, fp32, the sparse budgets of BENCH_OPTIONS, medians of alternating repetitions
in one process, speed-up = `full` layer time / mechanism layer time (> 1: faster).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from routeformer.attention import with_baseline
from routeformer.bench.layer_calls import BENCH_OPTIONS  # noqa: F401  (bench layers' budgets, re-exported)
from routeformer.bench.tables_and_plots import line_plot, markdown_table, provenance


def bench_layers(mechanisms: Sequence[str], lengths: Sequence[int], repeats: int,
                 progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Each mechanism's causal layer (D=256, 4 heads, B=1) at each T: median forward (inference)
    and forward + backward time, alternated in one process, and the peak memory of forward +
    backward; ratios against the `full` layer measured in the same rounds. Progress lines go to
    `progress` (default: stderr)."""
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    names = with_baseline(mechanisms)
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


def layer_bench_section(out: Path, bench_rows: list[dict[str, Any]]) -> list[str]:
    """The report section of a layer benchmark: a table of `bench_layers` rows and two plots
    (time, memory) written to `out`."""
    mechanisms = list(dict.fromkeys(row["mechanism"] for row in bench_rows))
    for key, name, ylabel in (("fwd_bwd_ms", "bench_time.png", "forward + backward ms"),
                              ("fwd_bwd_peak_mib", "bench_memory.png", "peak MiB (forward + backward)")):
        line_plot(out / name, {m: ([r["T"] for r in bench_rows if r["mechanism"] == m],
                                   [r[key] or 0.0 for r in bench_rows if r["mechanism"] == m])
                               for m in mechanisms},
                  xlabel="T", ylabel=ylabel, title=f"layer {ylabel} vs T (D=256, 4 heads, B=1)",
                  logx=True, logy=key == "fwd_bwd_ms")
    return ["## Layer time and memory vs T", (
        "Causal layers (projections included), D=256, 4 heads, B=1; local and Meta-Attention windows 256, "
        "top-k 64 keys, MiTA 64 landmarks of 64 keys, meta-token density 0.1; speed-up = `full` (SDPA) "
        "time / the mechanism's time in the same rounds (> 1: faster than full); forward in eval mode "
        "without gradients, forward + backward in train mode."),
        markdown_table(["T", "mechanism", "forward ms", "speed-up vs full", "fwd+bwd ms", "speed-up vs full",
                        "peak MiB"],
                       [[r["T"], r["mechanism"], r["forward_ms"], 1 / r["forward_vs_full"], r["fwd_bwd_ms"],
                         1 / r["fwd_bwd_vs_full"], "-" if r["fwd_bwd_peak_mib"] is None
                         else r["fwd_bwd_peak_mib"]] for r in bench_rows]),
        "Plots: `bench_time.png`, `bench_memory.png`."]


DEFAULT_MECHANISMS = ("local", "linear", "topk", "mita")


def command_layers(args) -> int:
    """`routeformer bench layers` (the CLI's arguments): print progress, write the table (and its
    plots and JSON beside it) with --output."""
    from routeformer.attention.registry import list_attentions

    mechanisms = list(args.mechanisms or DEFAULT_MECHANISMS)
    known = list(list_attentions())
    unknown = sorted(set(mechanisms) - set(known))
    if unknown:
        raise ValueError(f"--mechanisms: unknown {unknown}; allowed: {', '.join(known)}")
    output = Path(args.output) if args.output else None
    if output is not None:  # fail before minutes of timing, not after
        output.parent.mkdir(parents=True, exist_ok=True)
    if getattr(args, "split", False):
        return _command_split(args, mechanisms, output)
    # full is the baseline and gets its own row (its absolute times anchor the ratios)
    timed = with_baseline(mechanisms)
    rows = bench_layers(timed, args.lengths, args.repeats, progress=lambda line: print(line, flush=True))
    if output is not None:
        command = (f"routeformer bench layers --lengths {' '.join(map(str, args.lengths))} "
                   f"--repeats {args.repeats} --mechanisms {' '.join(mechanisms)} --output {args.output}")
        blocks = ["# Layer benchmark", provenance(command), *layer_bench_section(output.parent, rows)]
        output.write_text("\n\n".join(blocks) + "\n")
        output.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0


def _command_split(args, mechanisms: list[str], output: Path | None) -> int:
    """`bench layers --split`: each mechanism's training step split into its parts (layer_split.py)."""
    from routeformer.bench.layer_split import SPLIT_HEADER, bench_split, format_split_row

    names = with_baseline(mechanisms)
    rows = bench_split(names, args.lengths, args.repeats, progress=lambda line: print(line, flush=True))
    if output is not None:
        command = (f"routeformer bench layers --split --lengths {' '.join(map(str, args.lengths))} "
                   f"--repeats {args.repeats} --mechanisms {' '.join(mechanisms)} --output {args.output}")
        blocks = ["# Layer training step, split by part", provenance(command), (
            "Causal layers, D=256, 4 heads, B=1, the budgets of `bench layers`; one training step (forward "
            "in train mode, backward into input and weights) under torch.profiler; each part is the time in "
            "its ranges less nested ranges of other parts (see routeformer/bench/layer_split.py); medians of "
            f"{args.repeats} steps (percent of the median total)."),
            SPLIT_HEADER + "\n" + "\n".join(format_split_row(row) for row in rows)]
        output.write_text("\n\n".join(blocks) + "\n")
        output.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0
