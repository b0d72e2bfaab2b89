"""The `routeformer` command.

    routeformer compare [--quick | --long] [--mechanisms NAME ...] [--tasks lm mqar listops] [--corpus SPEC]
                        [--seeds N] [--workers N] [--out DIR] [--no-bench]
    routeformer train [--config NAME|PATH] [--fresh] [--key value ...]
    routeformer eval RUN_OR_CHECKPOINT [--corpus SPEC] [--max-tokens N]
    routeformer sample RUN_OR_CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]
    routeformer list
    routeformer bench ops|layers|topk|structural|meta|mita|meta_tokens|compile|generate|gpu
                      [--lengths 1024 4096 16384] [--repeats 5] [--window 256] [--output FILE]
    routeformer reproduce NAME [--quick] [--out DIR]      (routeformer reproduce --list)
    routeformer doctor [--length N]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = "char-lm"

# Exit statuses: 2 = bad input (arguments, config, a missing or corrupt checkpoint, a path that
# cannot be used); 1 = a run that failed on its own (training diverged); 130 = interrupted.
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


class UsageError(ValueError):
    """A command line argparse rejected."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line (`routeformer: error: ...`, exit 2,
    via `main`) instead of printing the usage block and exiting from inside the parser."""

    help_tail = None  # a callable returning text appended to --help (computed only when asked)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")

    def format_help(self) -> str:
        return super().format_help() + (self.help_tail() if self.help_tail else "")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _bounded_int(text, 0)


def _bounded_int(text: str, minimum: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text!r}")
    return value


def resolve_config(name_or_path: str) -> Path:
    """A path to a YAML file, or the name of a config shipped in routeformer/configs."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = CONFIG_DIR / f"{name_or_path}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ValueError(f"config {name_or_path!r} is neither a file nor a bundled config; bundled: {names}")


def command_compare(args: argparse.Namespace) -> int:
    from routeformer.compare.run import run_compare

    try:
        if args.long:
            report = _compare_long(args)
        else:
            report = run_compare(args.out or "runs/compare", mechanisms=args.mechanisms, tasks=args.tasks,
                                 quick=args.quick, corpus=args.corpus or "pydoc", bench=not args.no_bench,
                                 seeds=args.seeds, workers=args.workers)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(report.read_text())
    print(f"wrote {report.parent}/ (report.md, result.json, PNGs)")
    return 0


def _compare_long(args: argparse.Namespace):
    """`compare --long`: the long budget (compare/long_budget.py)."""
    from dataclasses import replace

    from routeformer.compare.long_budget import LONG, check_long_selection
    from routeformer.compare.long_run import run_compare_long

    if args.quick:
        raise ValueError("--quick and --long: choose one budget")
    if args.no_bench:
        raise ValueError("--no-bench: --long has no layer benchmark (it measures costs at the task lengths)")
    if args.seeds is not None and (args.seeds < 1):
        raise ValueError(f"--seeds must be a positive integer; got {args.seeds}")
    mechanisms, tasks = check_long_selection(args.mechanisms, args.tasks)
    budget = LONG if args.seeds is None else replace(LONG, seeds=args.seeds)
    command = "routeformer compare --long" + "".join([
        f" --tasks {' '.join(args.tasks)}" if args.tasks else "",
        f" --mechanisms {' '.join(args.mechanisms)}" if args.mechanisms else "",
        f" --seeds {args.seeds}" if args.seeds is not None else "",
        f" --corpus {args.corpus}" if args.corpus else ""])
    out = args.out or "runs/compare-long"
    return run_compare_long(budget, out, mechanisms=mechanisms, tasks=tasks, seeds=budget.seeds,
                            workers=args.workers, corpus=args.corpus, command=command)


def command_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from routeformer.train import load_config, train
    from routeformer.train.interrupts import RunInterrupted

    config = load_config(resolve_config(args.config), overrides)
    try:
        result = train(config, resume=not args.fresh)
    except RunInterrupted as interrupted:  # one line saying what was saved (rank 0 of torchrun only)
        if str(interrupted):
            print(f"routeformer: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("routeformer: interrupted before training began; run again to resume or start",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if result.final_eval is not None:  # under torchrun, rank 0 alone evaluates and reports
        skipped = {"skipped_steps": result.skipped_steps} if result.skipped_steps else {}
        print(json.dumps({"out_dir": str(result.out_dir), "steps": result.step,
                          "train_seconds": round(result.train_seconds, 1), **skipped, **result.final_eval}))
    return 0


def load_for_use(target: str):
    """(model, tokeniser, config, checkpoint file, step) for eval and sample. CheckpointError when
    a run directory's newest checkpoint is unreadable: an older state is used only when its file is
    named explicitly."""
    from routeformer.train.checkpoint import CheckpointError, choose_checkpoint, trained_model

    path, state, unreadable = choose_checkpoint(target)
    step = state.get("step")
    if unreadable:
        raise CheckpointError(
            f"the newest checkpoint of {target!r} is unreadable ({unreadable}); its newest intact one is "
            f"{str(path)!r} (step {step}), an older state: name that file to use it")
    return (*trained_model(state), path, step)


def command_eval(args: argparse.Namespace) -> int:
    from routeformer.data.corpora import load_corpus, load_data
    from routeformer.train.evaluate import evaluate_lm

    model, vocab, config, path, step = load_for_use(args.checkpoint)
    corpus = load_corpus(args.corpus) if args.corpus else load_data(config.data.corpus, config.data.path)
    ids = vocab.encode(corpus.val)
    density = config.data.meta_density  # a meta-token run is scored as it was trained
    meta = {"meta_density": density, "meta_id": vocab.pause_id} if density > 0 else {}
    result = evaluate_lm(model, ids, seq_len=config.data.seq_len, batch_size=config.train.batch_size,
                         max_tokens=args.max_tokens, **meta)
    print(json.dumps({"checkpoint": str(path), "step": step, "corpus": corpus.name, **result}))
    return 0


def command_sample(args: argparse.Namespace) -> int:
    import torch

    model, vocab, _, path, step = load_for_use(args.checkpoint)
    if args.temperature is not None and not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0; got {args.temperature!r}")
    prompt = vocab.encode(args.prompt)[None]
    if prompt.shape[1] == 0:
        raise ValueError("prompt must not be empty")
    generator = torch.Generator().manual_seed(args.seed)
    tokens = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                            generator=generator)
    print(vocab.decode(tokens[0].tolist()))
    print(f"routeformer: sampled from {str(path)!r} (step {step})", file=sys.stderr, flush=True)
    return 0


def command_export_hf(args: argparse.Namespace) -> int:
    try:
        from routeformer.integrations.hf.export import export_hf
    except ImportError as error:  # transformers is an optional extra
        raise ValueError(str(error)) from error
    out = export_hf(args.run_dir, args.out_dir)
    print(f"wrote {out}; load it with (the first import registers routeformer's model with transformers):\n"
          f"  import routeformer.integrations.hf\n"
          f"  from transformers import AutoModelForCausalLM\n"
          f"  model = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
          f"  (tokeniser: routeformer.data.tokenizers.tokenizer_from_dict(json.load(open("
          f"{str(out / 'routeformer_vocab.json')!r}))))")
    return 0


def command_doctor(args: argparse.Namespace) -> int:
    from routeformer.doctor import report

    print(report(args.length), end="")
    return 0


def command_list(args: argparse.Namespace) -> int:
    from routeformer.attention import list_attentions
    from routeformer.experiments.registry import list_experiments

    print("attention mechanisms:")
    for name, options in list_attentions().items():
        shown = ", ".join(f"{key}={value!r}" for key, value in options.items())
        print(f"  {name:12s} {shown}")
    print("experiments (routeformer reproduce NAME):")
    for name, experiment in list_experiments().items():
        print(f"  {name:14s} {experiment.description}")
    return 0


def command_reproduce(args: argparse.Namespace) -> int:
    from routeformer.experiments.registry import list_experiments, run_experiment

    if args.list or not args.name:
        for name, experiment in list_experiments().items():
            print(f"{name:14s} {experiment.description}")
        return 0
    report = run_experiment(args.name, args.out, quick=args.quick)
    print(report.read_text())
    print(f"wrote {report.parent}/ (result.json, report.md, PNGs)")
    return 0


def command_bench(args: argparse.Namespace) -> int:
    from routeformer.bench.ops_bench import TABLE_HEADER, bench_ops, markdown_report, rows_as_dicts

    settings = {"B": args.batch, "H": args.heads, "d": args.head_dim, "dtype": "fp32",
                "causal": True, "window": args.window, "repeats": args.repeats}
    if args.suite == "ops":
        from routeformer.bench.ops_suite import command_ops

        return command_ops(args)
    if args.suite == "layers":  # whole layers, projections included, against the full layer
        from routeformer.bench.layers_bench import command_layers

        return command_layers(args)
    if args.suite == "meta":
        return _bench_meta(args, settings)
    if args.suite == "compile":
        return _bench_compile(args)
    if args.suite == "generate":
        return _bench_generate(args)
    if args.suite == "mita":
        return _bench_mita(args, settings)
    if args.suite == "gpu":  # the Triton kernels on CUDA vs SDPA flash and FlexAttention
        from routeformer.bench.gpu_bench import command_gpu

        return command_gpu(args)
    print(TABLE_HEADER, flush=True)
    ops = None
    if args.suite == "meta_tokens":
        from routeformer.bench.meta_tokens_bench import meta_tokens_op_table

        ops = meta_tokens_op_table(args.batch, args.density)
        settings.update(density=args.density)
        settings.pop("window")
    if args.suite == "topk":
        from routeformer.bench.topk_bench import topk_op_table

        ops = topk_op_table(args.batch, args.heads, args.routing_dim, args.topk)
        settings.update(routing_dim=args.routing_dim, topk=args.topk)
    windows = []
    if args.suite == "structural":
        from routeformer.bench.structural_bench import (
            WINDOW_HEADER,
            expanding_windows,
            format_window_row,
            structural_op_table,
        )

        ops = structural_op_table(args.heads)
        windows = expanding_windows(args.lengths, batch=args.batch, heads=args.heads,
                                    head_dim=args.head_dim)
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


def _bench_generate(args: argparse.Namespace) -> int:
    from routeformer.bench.generate_bench import command_generate

    return command_generate(args)


def _bench_compile(args: argparse.Namespace) -> int:
    from routeformer.attention import list_attentions
    from routeformer.bench.compile_bench import HEADER, bench_compile, format_row
    from routeformer.bench.layers_bench import BENCH_OPTIONS
    from routeformer.bench.tables_and_plots import provenance

    registered = list(list_attentions())
    unknown = [name for name in args.mechanisms or [] if name not in registered]
    if unknown:
        raise ValueError(f"--mechanisms: unknown {unknown}; registered: {registered}")
    mechanisms = sorted(args.mechanisms or registered, key=lambda name: name != "full")
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


def _bench_mita(args: argparse.Namespace, settings: dict) -> int:
    from routeformer.bench.mita_bench import SCALING_HEADER, bench_mita, scaling_rows
    from routeformer.bench.ops_bench import TABLE_HEADER, markdown_report, rows_as_dicts

    settings = {**settings, "causal": "both", "landmarks": args.landmarks, "topk": args.topk,
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


def _bench_meta(args: argparse.Namespace, settings: dict) -> int:
    from routeformer.bench.meta_bench import (
        META_HEADER,
        ROUTING_HEADER,
        bench_meta,
        format_routing_row,
    )
    from routeformer.bench.ops_bench import format_row
    from routeformer.bench.timing import machine_description

    settings.update(D=args.dim, layer="meta vs full (projections included)")
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


def _config_keys_help() -> str:
    from routeformer.train.config import describe_keys

    return ("\nconfig keys (--key value; the code's defaults, which the --config file may change):\n"
            + describe_keys() + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="routeformer", description="Routed attention for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)

    compare = commands.add_parser(
        "compare", help="mechanisms on the same tasks, seeds and budget, one report",
        description="Train mechanisms on the same tasks (char LM, Zoology MQAR, ListOps; routeformer.tasks) "
                    "with one backbone, budget and batch stream per seed; report quality as mean ± sd over "
                    "seeds beside each task's chance level and measured shortcut baselines, executed "
                    "attention FLOPs, time and memory (report.md + result.json + PNGs). Finished runs are "
                    "kept: run it again to resume.")
    compare.add_argument("--quick", action="store_true",
                         help="the quick budget (about 10 minutes on 2 cores; a subset of mechanisms)")
    compare.add_argument("--long", action="store_true",
                         help="the long budget: recall at T=512 and a char LM at T=1024, evaluated at "
                              "1x/2x/4x, with costs at the same lengths (under 2 hours on 2 cores)")
    compare.add_argument("--mechanisms", nargs="+", default=None,
                         help="subset of `routeformer list` (default: the budget's selection)")
    compare.add_argument("--tasks", nargs="+", default=None,
                         help="subset of lm mqar listops (default: all)")
    compare.add_argument("--seeds", type=int, default=None, help="seeds per mechanism (default: 3)")
    compare.add_argument("--workers", type=int, default=2,
                         help="training processes, one thread each (default: 2)")
    compare.add_argument("--corpus", default=None,
                         help="LM corpus (default: the embedded pydoc; with --long, tinyshakespeare when "
                              "a local copy exists; wikitext2 for WikiText-2 text)")
    compare.add_argument("--out", default=None,
                         help="output directory (default: runs/compare, with --long runs/compare-long)")
    compare.add_argument("--no-bench", action="store_true", help="skip the layer time/memory benchmark")

    train = commands.add_parser(
        "train", help="train a character-level language model",
        description="Train a char-level LM. Extra --key value pairs override the config "
                    "(dotted, e.g. --model.attention local, or bare when unambiguous, e.g. --steps 100). "
                    "A run whose out_dir holds a checkpoint resumes from it.")
    train.add_argument("--config", default=DEFAULT_CONFIG,
                       help=f"YAML file or bundled config name (default: {DEFAULT_CONFIG})")
    train.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    train.help_tail = _config_keys_help

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on its validation split")
    evaluate.add_argument("checkpoint", help="run directory or checkpoint file")
    evaluate.add_argument("--corpus", help="evaluate on another corpus spec's validation split")
    evaluate.add_argument("--max-tokens", type=positive_int, default=None)

    sample = commands.add_parser("sample", help="generate text from a checkpoint")
    sample.add_argument("checkpoint", help="run directory or checkpoint file")
    sample.add_argument("--prompt", default="\n")
    sample.add_argument("--tokens", type=non_negative_int, default=200)
    sample.add_argument("--temperature", type=non_negative_float, default=0.8)
    sample.add_argument("--top-k", type=positive_int, default=None)
    sample.add_argument("--seed", type=int, default=0)

    commands.add_parser("list", help="list the registered attention mechanisms and their options")

    doctor = commands.add_parser("doctor", help="what this machine has (compiler, CPU, native kernels, "
                                                "triton, CUDA) and the backend each mechanism takes")
    doctor.add_argument("--length", type=positive_int, default=1100,
                        help="tokens of the probe input (above 1024: topk routes on every backend)")

    export_hf = commands.add_parser("export-hf", help="a trained checkpoint as a transformers model")
    export_hf.add_argument("run_dir", help="run directory or checkpoint file")
    export_hf.add_argument("out_dir", help="new directory for config.json + model.safetensors")

    bench = commands.add_parser("bench", help="speed and memory benchmarks")
    bench.add_argument("suite", choices=["ops", "layers", "topk", "structural", "meta", "mita", "meta_tokens",
                                         "compile", "generate", "gpu"])
    bench.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 4096, 16384])
    bench.add_argument("--repeats", type=positive_int, default=5)
    bench.add_argument("--window", type=positive_int, default=256)
    bench.add_argument("--batch", type=positive_int, default=1)
    bench.add_argument("--heads", type=positive_int, default=4)
    bench.add_argument("--head-dim", type=positive_int, default=64)
    bench.add_argument("--dim", type=positive_int, default=256, help="meta and compile suites: model dim D")
    bench.add_argument("--topk", type=positive_int, default=64,
                       help="topk: keys per query; mita: keys per expert")
    bench.add_argument("--landmarks", type=positive_int, default=64, help="mita suite: landmarks (experts)")
    bench.add_argument("--sdpa-up-to", type=positive_int, default=65536,
                       help="mita suite: longest T timed for SDPA")
    bench.add_argument("--causal-up-to", type=positive_int, default=65536,
                       help="mita suite: longest causal T")
    bench.add_argument("--routing-dim", type=positive_int, default=16, help="topk suite: routing dim")
    bench.add_argument("--density", type=non_negative_float, default=0.1,
                       help="meta_tokens suite: meta-token density")
    bench.add_argument("--new-tokens", type=positive_int, default=32, help="generate suite: tokens to sample")
    bench.add_argument("--depth", type=positive_int, default=1, help="generate suite: layers of the model")
    bench.add_argument("--decode-threads", type=positive_int, default=1,
                       help="generate suite: torch threads for the decode steps (the prefill uses all)")
    bench.add_argument("--up-to", nargs="+", default=None, metavar="MECHANISM=LENGTH",
                       help="generate suite: the longest context a mechanism runs at (its prefill is slow)")
    bench.add_argument("--reread", action="store_true",
                       help="generate suite: time generation with and without the cache (short contexts) "
                            "instead of the decode steps")
    bench.add_argument("--no-flex", action="store_true",
                       help="ops suite: leave FlexAttention out (compiling it takes seconds)")
    bench.add_argument("--ops", nargs="+", choices=("local", "linear", "topk"), default=None,
                       help="ops suite: time only these op families beside SDPA (default: all)")
    bench.add_argument("--mechanisms", nargs="+", default=None,
                       help="compile suite: the mechanisms to compile (default: every registered one); "
                            "layers suite: the ones timed against full (default: local linear topk mita); "
                            "generate suite: the ones decoded (default: every one with a cache)")
    bench.add_argument("--output", default=None, help="write a Markdown table (and JSON beside it)")

    reproduce = commands.add_parser("reproduce", help="run a reproduced paper experiment")
    reproduce.add_argument("name", nargs="?", help="experiment name (see --list)")
    reproduce.add_argument("--list", action="store_true", help="list the experiments")
    reproduce.add_argument("--quick", action="store_true", help="a reduced setting that runs in minutes")
    reproduce.add_argument("--out", default=None, help="output directory (default runs/NAME[-quick])")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad input ends in one line `routeformer: error: ...` and exit status 2,
    never a traceback (the error types below are the ones bad input raises); Ctrl-C at any moment
    ends in one line and exit status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("routeformer: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    from routeformer.train.checkpoint import CheckpointError
    from routeformer.train.guard import TrainingDiverged

    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "train":
            parser.error(f"unrecognised arguments: {' '.join(extra)}")
        if args.command == "train":
            return command_train(args, extra)
        handlers = {"compare": command_compare, "eval": command_eval, "sample": command_sample,
                    "list": command_list, "bench": command_bench, "reproduce": command_reproduce,
                    "export-hf": command_export_hf, "doctor": command_doctor}
        return handlers[args.command](args)
    except (ValueError, CheckpointError) as error:
        return _fail(error, EXIT_BAD_INPUT)
    except OSError as error:  # a path that cannot be read or written: says which and why
        return _fail(error, EXIT_BAD_INPUT)
    except TrainingDiverged as error:
        return _fail(error, EXIT_FAILED)


def _fail(error: BaseException, status: int) -> int:
    message = " ".join(str(error).split())  # one line, whatever the exception held
    print(f"routeformer: error: {message or type(error).__name__}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
