"""`routeformer bench SUITE`: runs one benchmark suite, prints its table and, with --output, writes it
as Markdown with a JSON copy beside it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path


def _op_settings(args: argparse.Namespace) -> dict:
    return {"B": args.batch, "H": args.heads, "d": args.head_dim, "dtype": "fp32",
            "causal": True, "window": args.window, "repeats": args.repeats}


def command_bench(args: argparse.Namespace) -> int:
    """Run the suite `args.suite` names (SUITES below). An --output without a suffix gets `.md` (the
    JSON copy is written beside it with `.json`)."""
    if args.output and not Path(args.output).suffix:
        args.output = str(Path(args.output).with_suffix(".md"))
    return SUITES[args.suite](args)


def _bench_ops(args: argparse.Namespace) -> int:
    from routeformer.bench.ops_suite import command_ops

    return command_ops(args)


def _bench_layers(args: argparse.Namespace) -> int:  # whole layers, projections included, vs full
    from routeformer.bench.layers_bench import command_layers

    return command_layers(args)


def _bench_gpu(args: argparse.Namespace) -> int:  # the Triton kernels on CUDA vs SDPA flash and Flex
    from routeformer.bench.gpu_bench import command_gpu

    return command_gpu(args)


def _meta_tokens_table(args: argparse.Namespace, settings: dict) -> tuple[list, list]:
    from routeformer.bench.meta_tokens_bench import meta_tokens_op_table

    settings.update(density=args.density)
    settings.pop("window")
    return meta_tokens_op_table(args.batch, args.density), []


def _topk_table(args: argparse.Namespace, settings: dict) -> tuple[list, list]:
    from routeformer.bench.topk_bench import topk_op_table

    settings.update(routing_dim=args.routing_dim, topk=args.topk)
    return topk_op_table(args.batch, args.heads, args.routing_dim, args.topk), []


def _structural_table(args: argparse.Namespace, settings: dict) -> tuple[list, list]:
    from routeformer.bench.structural_bench import expanding_windows, structural_op_table

    windows = expanding_windows(args.lengths, batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    return structural_op_table(args.heads), windows


def _op_table_suite(tables: Callable[[argparse.Namespace, dict], tuple[list, list]]
                    ) -> Callable[[argparse.Namespace], int]:
    """A suite that times an op table against SDPA (bench_ops) and writes it as Markdown + JSON;
    `tables(args, settings)` gives the ops (and, for structural, expanding's windows)."""
    def run(args: argparse.Namespace) -> int:
        from routeformer.bench.ops_bench import TABLE_HEADER, bench_ops, markdown_report, rows_as_dicts
        from routeformer.bench.structural_bench import WINDOW_HEADER, format_window_row

        settings = _op_settings(args)
        print(TABLE_HEADER, flush=True)
        ops, windows = tables(args, settings)
        rows = bench_ops(args.lengths, repeats=args.repeats, window=args.window, batch=args.batch,
                         heads=args.heads, head_dim=args.head_dim, ops=ops,
                         progress=lambda line: print(line, flush=True))
        if windows:
            print("\n" + WINDOW_HEADER + "\n" + "\n".join(format_window_row(w) for w in windows), flush=True)
        if args.output:
            output = Path(args.output)
            output.parent.mkdir(parents=True, exist_ok=True)
            report = markdown_report(rows, settings, title=f"{args.suite} benchmark")
            if windows:
                report += "\nexpanding's final windows on the same inputs:\n\n" + WINDOW_HEADER + "\n"
                report += "\n".join(format_window_row(w) for w in windows) + "\n"
            output.write_text(report)
            output.with_suffix(".json").write_text(json.dumps(
                {"settings": settings, "rows": rows_as_dicts(rows), "expanding_windows": windows}, indent=2))
            print(f"wrote {output} and {output.with_suffix('.json')}")
        return 0
    return run


def _bench_generate(args: argparse.Namespace) -> int:
    from routeformer.bench.generate_bench import command_generate

    return command_generate(args)


def _bench_compile(args: argparse.Namespace) -> int:
    from routeformer.attention import baseline_first, list_attentions
    from routeformer.bench.compile_bench import HEADER, bench_compile, format_row
    from routeformer.bench.layers_bench import BENCH_OPTIONS
    from routeformer.bench.tables_and_plots import provenance

    registered = list(list_attentions())
    unknown = [name for name in args.mechanisms or [] if name not in registered]
    if unknown:
        raise ValueError(f"--mechanisms: unknown {unknown}; registered: {registered}")
    mechanisms = baseline_first(args.mechanisms or registered)
    print(HEADER, flush=True)
    rows = []
    for length in args.lengths:
        print(f"T = {length}", flush=True)
        rows += bench_compile(mechanisms, length, repeats=args.repeats, dim=args.dim, heads=args.heads,
                              options=BENCH_OPTIONS)
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        lengths = " ".join(map(str, args.lengths))
        command = f"routeformer bench compile --lengths {lengths} --repeats {args.repeats}" + (
            f" --mechanisms {' '.join(args.mechanisms)}" if args.mechanisms else "")
        lines = ["# torch.compile benchmark", "",
                 provenance(command) + " Causal layers, "
                 f"D={args.dim}, {args.heads} heads, B=1; local/meta windows 256, top-k 64 keys, MiTA 64 "
                 "landmarks of 64 keys, meta-token density 0.1. Graphs/breaks: `torch._dynamo.explain` of "
                 "one inference forward. Compile s: the first compiled forward and forward + backward. "
                 f"Times: medians of {args.repeats} alternating repetitions, eager vs compiled "
                 "(default inductor backend) in the same process; speed-up = eager time / compiled "
                 "time (> 1: compiled is faster). Per-round speed-up: eager / compiled of each round "
                 "(the two run back to back, order alternating), median (lower-upper quartile).", ""]
        for length in args.lengths:
            lines += [f"T = {length}:", "", HEADER, *[format_row(r) for r in rows if r["T"] == length], ""]
        output.write_text("\n".join(lines))
        output.with_suffix(".json").write_text(json.dumps({"rows": rows}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0


def _bench_mita(args: argparse.Namespace) -> int:
    from routeformer.bench.mita_bench import SCALING_HEADER, bench_mita, scaling_rows
    from routeformer.bench.ops_bench import TABLE_HEADER, markdown_report, rows_as_dicts

    settings = {**_op_settings(args), "causal": "both", "landmarks": args.landmarks, "topk": args.topk,
                "sdpa_up_to": args.sdpa_up_to, "causal_up_to": args.causal_up_to}
    settings.pop("window")
    print(TABLE_HEADER, flush=True)
    rows = bench_mita(args.lengths, landmarks=args.landmarks, topk=args.topk, repeats=args.repeats,
                      batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                      sdpa_up_to=args.sdpa_up_to, causal_up_to=args.causal_up_to,
                      progress=lambda line: print(line, flush=True))
    scaling = SCALING_HEADER + "\n" + "\n".join(scaling_rows(rows))
    print("\n" + scaling, flush=True)
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        report = markdown_report(rows, settings).replace("# Ops benchmark", "# mita benchmark")
        output.write_text(report + "\nPer token (flat = linear in T):\n\n" + scaling + "\n")
        output.with_suffix(".json").write_text(json.dumps(
            {"settings": settings, "rows": rows_as_dicts(rows)}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0


def _bench_meta(args: argparse.Namespace) -> int:
    from routeformer.bench.meta_bench import (
        META_HEADER,
        ROUTING_HEADER,
        bench_meta,
        format_routing_row,
    )
    from routeformer.bench.ops_bench import format_row
    from routeformer.bench.timing import machine_description

    settings = {**_op_settings(args), "D": args.dim, "layer": "meta vs full (projections included)"}
    print(META_HEADER, flush=True)
    rows, routing = bench_meta(args.lengths, dim=args.dim, heads=args.heads, window=args.window,
                               batch=args.batch, repeats=args.repeats,
                               progress=lambda line: print(line, flush=True))
    routing_table = ROUTING_HEADER + "\n" + "\n".join(format_routing_row(r) for r in routing)
    print("\n" + routing_table, flush=True)
    if args.output:
        import datetime

        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        output.write_text("\n".join([
            "# meta layer benchmark", "", f"Measured {now} on {machine_description()}.",
            f"Settings: {settings}. Command: `routeformer bench meta` with these settings. Medians of "
            f"{args.repeats} alternating repetitions; speedup = full layer time / layer time in the same "
            "process; peak MiB = extra resident memory of one call.", "",
            META_HEADER, *[format_row(row) for row in rows], "", "What each layer executed:", "",
            routing_table, ""]))
        output.with_suffix(".json").write_text(json.dumps(
            {"settings": settings, "rows": [asdict(row) for row in rows], "routing": routing}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0



def _bench_steps(args: argparse.Namespace) -> int:
    from routeformer.attention import list_attentions
    from routeformer.bench.model_steps import STEP_HEADER, model_step_rows
    from routeformer.bench.timing import machine_description
    from routeformer.compare.budgets import LONG, options_for
    from routeformer.train.on_task import spec_dict

    mechanisms = args.mechanisms or ["topk", "mita", "meta"]
    unknown = [m for m in mechanisms if m not in list_attentions()]
    if unknown:
        raise ValueError(f"mechanisms: unknown {unknown}; registered: {sorted(list_attentions())}")
    lengths = args.lengths if args.lengths != [1024, 4096, 16384] else [512, 1024, 2048, 4096]
    layer_options, prepare = options_for, None
    if args.meta_shares is not None:  # meta as compare --long trains it, at a trained router's shares
        from routeformer.attention.base import skip_schedules

        recipes = LONG.tasks["mqar"].mechanism_options  # meta's training recipe

        def layer_options(name: str, length: int) -> dict:
            return {**options_for(name, length), **recipes.get(name, {})}

        def prepare(model) -> None:
            skip_schedules(model, tuple(args.meta_shares))

    print(STEP_HEADER, flush=True)
    rows = model_step_rows(mechanisms, lengths, options_for=layer_options, spec=LONG.spec, tokens=args.tokens,
                           repeats=args.repeats, prepare=prepare,
                           progress=lambda line: print(line, flush=True))
    if args.output:
        from routeformer.bench.model_steps import format_step_row

        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        settings = {"model": spec_dict(LONG.spec), "tokens_per_step": args.tokens, "threads": 1,
                    "meta_shares": args.meta_shares,
                    "repeats": args.repeats, "machine": machine_description()}
        output.write_text("# Training step of compare --long's model, against full in the same rounds\n\n"
                          f"Settings: {json.dumps(settings)}\n\n" + STEP_HEADER + "\n"
                          + "\n".join(format_step_row(row) for row in rows) + "\n")
        output.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0


# `routeformer bench SUITE`: each suite's runner (the parser's choices are these keys).
SUITES = {
    "ops": _bench_ops, "layers": _bench_layers, "steps": _bench_steps, "meta": _bench_meta,
    "compile": _bench_compile, "generate": _bench_generate, "mita": _bench_mita, "gpu": _bench_gpu,
    "meta_tokens": _op_table_suite(_meta_tokens_table), "topk": _op_table_suite(_topk_table),
    "structural": _op_table_suite(_structural_table),
}
