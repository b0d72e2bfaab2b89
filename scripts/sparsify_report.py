"""Measure what converting a dense task run to a routed one keeps and saves (`--mechanism`: topk,
the default, meta or mita): for each K (topk's budget; one row for the others) and conversion seed,
the converted model's task metric beside the dense model's at T, 2T and 4T (where the task and the
model's positions allow), routing recall per layer at T, the conversion's tokens as a fraction of
the source's; and, per K (seed 0), prefill time and cached-decode time per token against the dense
model (alternating rounds in this process, medians of per-round ratios). Writes report.json and
report.md under --out.

    python scripts/sparsify_report.py --source RUN_DIR --sparse-steps 300 --out docs/results/sparsify/NAME
    python scripts/sparsify_report.py --train-dense mqar --dense-steps 200 --seq-len 64 --out DIR
    python scripts/sparsify_report.py --source RUN_DIR --mechanism mita --sparse-steps 120 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import torch

from routeformer.bench.generate_bench import CachedDecoder, decode_step_times
from routeformer.bench.timing import machine_description, ratio_quartiles, round_times
from routeformer.cli import main as routeformer_main
from routeformer.cli.sparsify_command import layer_options
from routeformer.runner.seeds import seed_sweep
from routeformer.tasks import build_task
from routeformer.train.checkpoint import load_run_model
from routeformer.train.on_task import evaluate_on_task
from routeformer.train.sparsify import (
    STAGE1_LR,
    STAGE2_LR_SHARE,
    convert_on_task,
    default_steps,
    run_tokens,
    sparsify,
)

TEST_TOKENS = 262_144  # test tokens per length (compare --long's)
MIN_SEQUENCES = 4


def _at_length(model, task_name, options, length, test_tokens):
    """The metric at sequence length `length`, or the reason it cannot be measured."""
    if "seq_len" not in options:
        return {"error": "the task has no seq_len option"}
    try:
        task = build_task(task_name, **{**options, "seq_len": length})
        return evaluate_on_task(model, task, "test", max(MIN_SEQUENCES, test_tokens // length))
    except (ValueError, RuntimeError, IndexError) as error:
        return {"error": " ".join(str(error).split())[:200]}


@torch.no_grad()
def _recall_per_layer(model, task, sequences):
    inputs, labels = task.fixed_sample("test", sequences)
    model.eval()
    result = model(inputs, labels, mask=task.mask(inputs), logits_at_labels=True)
    return [float(layer["routing_recall"]) if "routing_recall" in layer else None for layer in result.stats]


@torch.no_grad()
def _prefill_ratios(dense, routed, lengths, repeats, vocab):
    """Per length: (quartiles of routed / dense forward time per round, dense median s, routed median s)."""
    rows = []
    for length in lengths:
        tokens = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        times = round_times({"dense": lambda tokens=tokens: dense(tokens),
                             "routed": lambda tokens=tokens: routed(tokens)}, repeats)
        rows.append({"length": length, "ratio": ratio_quartiles(times["routed"], times["dense"]),
                     "dense_s": statistics.median(times["dense"]),
                     "routed_s": statistics.median(times["routed"])})
    return rows


@torch.no_grad()
def _decode_ratios(dense, routed, contexts, steps, vocab):
    """Per context: each model reads the same prompt into its cache, then both decode `steps`
    greedy tokens in alternating rounds; quartiles of the per-step time ratio routed / dense."""
    rows = []
    for context in contexts:
        prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(context))
        decoders = {name: CachedDecoder.prefill(model, prompt, reserve=context + steps + 2)
                    for name, model in (("dense", dense), ("routed", routed))}
        times = decode_step_times(decoders, steps, warmup=1)
        rows.append({"context": context, "ratio": ratio_quartiles(times["routed"], times["dense"]),
                     "dense_ms": 1e3 * statistics.median(times["dense"]),
                     "routed_ms": 1e3 * statistics.median(times["routed"])})
    return rows


def _timing(dense, routed, k, lengths, args, vocab):
    dense.eval()
    routed.eval()
    timed = lengths[::2]  # T and 4T
    return {"topk": k, "prefill": _prefill_ratios(dense, routed, timed, args.repeats, vocab),
            "decode": _decode_ratios(dense, routed, timed, args.decode_steps, vocab)}


def _time_kept(out: Path, args) -> None:
    """--timing-only: time the seed-0 models an earlier invocation kept under out/models against
    the dense source, and rewrite the report with the timing (on a quiet machine)."""
    report = json.loads((out / "report.json").read_text())
    run = load_run_model(report["source"])
    lengths = [run.task.seq_len * factor for factor in (1, 2, 4)]
    report["timing"] = []
    mechanism = report.get("mechanism", "topk")
    for k in _budgets(report["rows"]):
        kept = torch.load(out / "models" / _model_file(mechanism, k), weights_only=True)
        routed = sparsify(run.model, mechanism, options=kept["options"])
        routed.load_state_dict(kept["state"])
        report["timing"].append(_timing(run.model, routed, k, lengths, args, run.model.config.vocab_size))
        print(json.dumps(report["timing"][-1]), flush=True)
    report["timing_measured"] = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                                 "machine": machine_description(),
                                 "command": "python scripts/sparsify_report.py " + " ".join(sys.argv[1:])}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report, lengths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="a dense task run directory")
    parser.add_argument("--train-dense", default=None, metavar="TASK", help="train a dense run of TASK first")
    parser.add_argument("--dense-steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--option", action="append", default=[], help="task option of the dense run")
    parser.add_argument("--mechanism", default="topk", help="the routed attention (topk, meta, mita)")
    parser.add_argument("--layer-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of every converted layer besides topk's K (repeatable)")
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--seeds", type=int, default=3, help="conversion seeds at --main-k")
    parser.add_argument("--main-k", type=int, default=64, help="the K the headline rows use")
    parser.add_argument("--sweep-seeds", type=int, default=None, help="seeds at other K (default: --seeds)")
    parser.add_argument("--steps", type=int, default=None, help="stage-1 steps (default: the library's)")
    parser.add_argument("--sparse-steps", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the source's last stage's")
    parser.add_argument("--test-tokens", type=int, default=TEST_TOKENS, help="test tokens per length")
    parser.add_argument("--repeats", type=int, default=5, help="alternating prefill rounds")
    parser.add_argument("--decode-steps", type=int, default=32, help="alternating decode rounds")
    parser.add_argument("--no-timing", action="store_true", help="convert and test only")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite report.md from the report.json under --out (no training, no timing)")
    parser.add_argument("--timing-only", action="store_true",
                        help="time the models an earlier invocation kept in --out (on a quiet machine)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (compare trains on one)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.timing_only:
        _time_kept(out, args)
        return
    if args.render_only:
        report = json.loads((out / "report.json").read_text())
        (out / "report.md").write_text(_markdown(report, [int(key) for key in report["dense"]]))
        print(f"rewrote {out / 'report.md'}")
        return
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    source = args.source
    if source is None:
        source = str(out / "dense-run")
        argv = ["train", "--task", args.train_dense, "--steps", str(args.dense_steps), "--seq-len",
                str(args.seq_len), "--evals", "1", "--fresh", "--out", source]
        for option in args.option:
            argv += ["--option", option]
        if routeformer_main(argv) != 0:
            raise SystemExit("the dense run failed")
    run = load_run_model(source)
    options = run.config["task_options"]
    schedule = run.config["setup"]["schedule"]
    source_tokens = run_tokens(run.config, run.task.seq_len)
    lengths = [run.task.seq_len * factor for factor in (1, 2, 4)]
    dense = {str(length): _at_length(run.model, run.config["task"], options, length, args.test_tokens)
             for length in lengths}
    steps = args.steps if args.steps is not None else default_steps(run.step, args.mechanism)
    batch_size = args.batch_size or schedule["batch_size"]
    sparse_lr = STAGE2_LR_SHARE * schedule["lr"]
    vocab = run.model.config.vocab_size
    chosen = layer_options(args.layer_option)
    rows, timing = [], []
    budgets = args.ks if args.mechanism == "topk" else [None]

    def seeds_of(k):  # the main row's seeds, or the sweep's for every other K
        main_row = k is None or k == args.main_k
        return range(args.seeds if main_row or args.sweep_seeds is None else args.sweep_seeds)

    for k, seed in seed_sweep(budgets, seeds_of, seed_major=False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # K >= T: the layer says it reads every key
            routed, record = convert_on_task(
                run.model, run.task, args.mechanism,
                options={**chosen, "topk": k} if k is not None else chosen, steps=steps,
                sparse_steps=args.sparse_steps, batch_size=batch_size, lr=STAGE1_LR, sparse_lr=sparse_lr,
                seed=seed, evals=1,
                validation_sequences=max(MIN_SEQUENCES, args.test_tokens // lengths[0] // 4))
            quality = {str(length): _at_length(routed, run.config["task"], options, length,
                                               args.test_tokens) for length in lengths}
            recall = _recall_per_layer(routed, run.task, MIN_SEQUENCES)
            if seed == 0:  # kept for --timing-only
                (out / "models").mkdir(exist_ok=True)
                torch.save({"options": record["options"], "state": routed.state_dict()},
                           out / "models" / _model_file(args.mechanism, k))
            if seed == 0 and not args.no_timing:
                timing.append(_timing(run.model, routed, k, lengths, args, vocab))
        warmup = record["stages"].get("dense_warmup", {"history": [{"aux_loss": None}]})
        kl = [entry["aux_loss"] for entry in warmup["history"]]
        rows.append({"topk": k, "seed": seed, "quality": quality, "routing_recall_per_layer": recall,
                     "stage1_kl_end": kl[-1], "tokens": record["tokens"],
                     "tokens_fraction_of_source": record["tokens"] / source_tokens,
                     "seconds": sum(stage["train_seconds"] for stage in record["stages"].values())})
        at_t = quality[str(lengths[0])].get(run.task.metric)
        print(json.dumps({"topk": k, "seed": seed, "metric_at_T": at_t, "recall": recall}), flush=True)
    report = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine_description(),
              "command": "python scripts/sparsify_report.py " + " ".join(sys.argv[1:]),
              "source": source, "source_step": run.step, "source_tokens": source_tokens,
              "task": run.config["task"], "task_options": options, "model": run.config["spec"],
              "metric": run.task.metric, "mechanism": args.mechanism,
              "layer_options": chosen, "stage1_steps": steps,
              "sparse_steps": args.sparse_steps,
              "sparse_lr": sparse_lr, "batch_size": batch_size, "test_tokens": args.test_tokens,
              "dense": dense, "rows": rows, "timing": timing,
              "wall_seconds": time.perf_counter() - began}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report, lengths))


def _budgets(rows):
    """topk's K of the rows, in order (None, once, for a mechanism without one)."""
    return sorted({row["topk"] for row in rows}, key=lambda k: -1 if k is None else k)


def _model_file(mechanism, k):
    return f"{mechanism}{'' if k is None else k}.pt"


def _stage1_text(report):
    mechanism = report.get("mechanism", "topk")
    if not report["stage1_steps"]:
        return f"no stage 1 ({mechanism} has no parameters of its own)"
    trained = {"topk": "topk's router trained by its KL to dense attention",
               "meta": "meta's controller trained by the task loss and its aux loss"}[mechanism]
    return f"stage 1, {report['stage1_steps']} steps, the dense weights frozen and {trained}"


def _options_text(options):
    if not options:
        return "the registered defaults"
    return ", ".join(f"`{key}={value!r}`" for key, value in options.items())


def _k(k):
    return "—" if k is None else str(k)


def _metric(entry, metric):
    return f"{entry[metric]:.3f}" if metric in entry else f"n/a ({entry.get('error', '')[:60]})"


def _mean_sd(values):
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _markdown(report, lengths):
    metric = report["metric"]
    mechanism = report.get("mechanism", "topk")
    lines = [f"# {mechanism} conversion of a dense {report['task']} run",
             "",
             f"Measured {report['date']} on {report['machine']}. Command: "
             f"`{report['command']}`. Wall-clock: {report['wall_seconds']:.0f} s.",
             "",
             f"Source: `{report['source']}`, {report['task']} {report['task_options']}, backbone "
             f"{report['model']}, {report['source_step']} training steps ({report['source_tokens']} tokens). "
             f"Conversion (train/sparsify.py): {_stage1_text(report)}; stage 2, "
             f"{report['sparse_steps']} steps of the task loss at lr {report['sparse_lr']:.3g}; batch "
             f"{report['batch_size']}. {mechanism}'s options besides K: "
             f"{_options_text(report.get('layer_options'))}. Test split, {report['test_tokens']} tokens "
             "per length.",
             "",
             f"Dense {metric}: " + ", ".join(f"T={length}: {_metric(report['dense'][str(length)], metric)}"
                                             for length in lengths),
             "",
             f"## Quality against K (mean ± sd over conversion seeds; Δ vs dense at T = {lengths[0]})",
             "",
             "| K | seeds | " + " | ".join(f"{metric} T={length}" for length in lengths)
             + f" | Δ at T={lengths[0]} | attention FLOPs / dense at T={lengths[0]} | tokens / source's |",
             "|---" * (len(lengths) + 5) + "|"]
    dense_t = report["dense"][str(lengths[0])].get(metric)
    for k in _budgets(report["rows"]):
        chosen = [row for row in report["rows"] if row["topk"] == k]
        cells = [_mean_sd([row["quality"][str(length)][metric] for row in chosen
                           if metric in row["quality"][str(length)]]) for length in lengths]
        deltas = [row["quality"][str(lengths[0])][metric] - dense_t for row in chosen
                  if dense_t is not None and metric in row["quality"][str(lengths[0])]]
        flops = [row["quality"][str(lengths[0])].get("attention_flops_per_token") for row in chosen]
        dense_flops = report["dense"][str(lengths[0])].get("attention_flops_per_token")
        share = f"{statistics.mean(flops) / dense_flops:.2f}" if dense_flops and None not in flops else "n/a"
        lines.append(f"| {_k(k)} | {len(chosen)} | " + " | ".join(cells)
                     + f" | {_mean_sd(deltas)} | {share} | {chosen[0]['tokens_fraction_of_source']:.3f} |")
    lines += ["", "## Every conversion", "",
              "| K | seed | " + " | ".join(f"{metric} T={length}" for length in lengths)
              + " | routing recall per layer | stage-1 KL at end | seconds |",
              "|---" * (len(lengths) + 5) + "|"]
    for row in report["rows"]:
        recall = ", ".join("-" if value is None else f"{value:.3f}"
                           for value in row["routing_recall_per_layer"])
        kl = "-" if row["stage1_kl_end"] is None else f"{row['stage1_kl_end']:.4f}"
        lines.append(f"| {_k(row['topk'])} | {row['seed']} | "
                     + " | ".join(_metric(row["quality"][str(length)], metric) for length in lengths)
                     + f" | {recall} | {kl} | {row['seconds']:.0f} |")
    if report["timing"]:
        measured = report.get("timing_measured")
        when = (f"Measured {measured['date']} on {measured['machine']}: this timing "
                f"(`{measured['command']}`), on the models the conversion kept. " if measured else "")
        lines += ["", "## Cost against the dense model (seed 0 of each K)", "",
                  f"{when}One process, one sequence.", "",
                  "Prefill: one sequence forward, medians of alternating rounds; decode: per-token time of "
                  "greedy cached steps after the same prompt, alternating. Ratios: the median (lower–upper "
                  "quartile) of the per-round ratios converted / dense (< 1: the converted model is faster).",
                  "", "| K | what | length | dense | converted | ratio |", "|---|---|---|---|---|---|"]
        for entry in report["timing"]:
            for row in entry["prefill"]:
                low, mid, high = row["ratio"]
                lines.append(f"| {_k(entry['topk'])} | prefill | {row['length']} | "
                             f"{1e3 * row['dense_s']:.0f} ms | {1e3 * row['routed_s']:.0f} ms | "
                             f"{mid:.2f} ({low:.2f}–{high:.2f}) |")
            for row in entry["decode"]:
                low, mid, high = row["ratio"]
                lines.append(f"| {_k(entry['topk'])} | decode / token | {row['context']} | "
                             f"{row['dense_ms']:.2f} ms | {row['routed_ms']:.2f} ms | "
                             f"{mid:.2f} ({low:.2f}–{high:.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
