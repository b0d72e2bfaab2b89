"""`routeformer bench layers`: whole causal layers (projections included) against the `full` layer.

The op benchmarks (`bench ops`) time the attention alone; a user swaps a whole layer, whose Q/K/V
and output projections cost the same for every mechanism and dilute the op's speed-up. This runs
the layer benchmark of `routeformer compare` on its own (no training): D=256, 4 heads, B=1, fp32,
the sparse budgets of compare_bench.BENCH_OPTIONS, medians of alternating repetitions in one
process, speed-up = `full` layer time / mechanism layer time (> 1: faster).
"""

from __future__ import annotations

import json
from pathlib import Path

from routeformer.attention.registry import list_attentions
from routeformer.experiments.compare_bench import bench_layers
from routeformer.experiments.compare_report import _bench_section
from routeformer.experiments.report import provenance

DEFAULT_MECHANISMS = ("local", "linear", "topk", "mita")


def command_layers(args) -> int:
    """`routeformer bench layers` (the CLI's arguments): print progress, write the table (and its
    plots and JSON beside it) with --output."""
    mechanisms = list(args.mechanisms or DEFAULT_MECHANISMS)
    known = list(list_attentions())
    unknown = sorted(set(mechanisms) - set(known))
    if unknown:
        raise ValueError(f"--mechanisms: unknown {unknown}; allowed: {', '.join(known)}")
    output = Path(args.output) if args.output else None
    if output is not None:  # fail before minutes of timing, not after
        output.parent.mkdir(parents=True, exist_ok=True)
    # full is the baseline and gets its own row (its absolute times anchor the ratios)
    timed = ["full", *[m for m in mechanisms if m != "full"]]
    rows = bench_layers(timed, args.lengths, args.repeats, progress=lambda line: print(line, flush=True))
    if output is not None:
        command = (f"routeformer bench layers --lengths {' '.join(map(str, args.lengths))} "
                   f"--repeats {args.repeats} --mechanisms {' '.join(mechanisms)} --output {args.output}")
        blocks = ["# Layer benchmark", provenance(command), *_bench_section(output.parent, rows)]
        output.write_text("\n\n".join(blocks) + "\n")
        output.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0
