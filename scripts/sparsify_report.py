"""Measure what converting a dense task run to topk keeps: for each K and conversion seed, the
converted model's task metric beside the dense model's at T (and at 2T, 4T where the task and the
model's positions allow), routing recall per layer at T, and the conversion's tokens as a fraction
of the source's. Writes report.json and report.md under --out.

    python scripts/sparsify_report.py --source runs/mqar-full --out docs/results/sparsify/NAME
    python scripts/sparsify_report.py --train-dense mqar --dense-steps 200 --seq-len 64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import torch

from routeformer.cli import main as routeformer_main
from routeformer.tasks import build_task
from routeformer.train.checkpoint import load_run_model
from routeformer.train.on_task import evaluate_on_task
from routeformer.train.sparsify import convert_on_task, default_steps


def _at_length(model, task_name, options, length, sequences):
    """The metric at sequence length `length`, or the reason it cannot be measured."""
    if "seq_len" not in options:
        return {"error": "the task has no seq_len option"}
    try:
        task = build_task(task_name, **{**options, "seq_len": length})
        return evaluate_on_task(model, task, "test", sequences)
    except (ValueError, RuntimeError, IndexError) as error:
        return {"error": " ".join(str(error).split())[:200]}


@torch.no_grad()
def _recall_per_layer(model, task, sequences):
    inputs, labels = task.fixed_sample("test", sequences)
    model.eval()
    result = model(inputs, labels, mask=task.mask(inputs), logits_at_labels=True)
    return [float(layer["routing_recall"]) if "routing_recall" in layer else None for layer in result.stats]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="a dense task run directory")
    parser.add_argument("--train-dense", default=None, metavar="TASK", help="train a dense run of TASK first")
    parser.add_argument("--dense-steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--option", action="append", default=[], help="task option of the dense run")
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="stage-1 steps (default: the library's)")
    parser.add_argument("--sparse-steps", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=256, help="test sequences per length")
    parser.add_argument("--machine", default=platform.processor() or platform.machine())
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
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
    source_tokens = run.step * schedule["batch_size"] * run.task.seq_len
    lengths = [run.task.seq_len * factor for factor in (1, 2, 4)]
    dense = {str(length): _at_length(run.model, run.config["task"], options, length, args.sequences)
             for length in lengths}
    steps = args.steps or default_steps(run.step)
    rows = []
    for k in args.ks:
        for seed in range(args.seeds):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # K >= T: the layer says it reads every key
                routed, record = convert_on_task(
                    run.model, run.task, "topk", options={"topk": k}, steps=steps,
                    sparse_steps=args.sparse_steps, batch_size=args.batch_size, seed=seed, evals=1,
                    validation_sequences=64)
                quality = {str(length): _at_length(routed, run.config["task"], options, length,
                                                   args.sequences) for length in lengths}
                recall = _recall_per_layer(routed, run.task, min(args.sequences, 128))
            kl = [entry["aux_loss"] for entry in record["stages"]["dense_warmup"]["history"]]
            rows.append({"topk": k, "seed": seed, "quality": quality, "routing_recall_per_layer": recall,
                         "stage1_kl_end": kl[-1], "tokens": record["tokens"],
                         "tokens_fraction_of_source": record["tokens"] / source_tokens})
            at_t = quality[str(lengths[0])].get(run.task.metric)
            print(json.dumps({"topk": k, "seed": seed, "metric_at_T": at_t, "recall": recall}), flush=True)
    report = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": args.machine,
              "source": source, "source_step": run.step, "source_tokens": source_tokens,
              "task": run.config["task"], "task_options": options, "model": run.config["spec"],
              "metric": run.task.metric, "stage1_steps": steps, "sparse_steps": args.sparse_steps,
              "batch_size": args.batch_size, "dense": dense, "rows": rows,
              "wall_seconds": time.perf_counter() - began}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report, lengths))


def _metric(entry, metric):
    return f"{entry[metric]:.3f}" if metric in entry else f"n/a ({entry.get('error', '')[:60]})"


def _markdown(report, lengths):
    metric = report["metric"]
    lines = [f"# topk conversion of a dense {report['task']} run",
             "",
             f"Measured {report['date']} on {report['machine']}. Source: {report['task']} "
             f"{report['task_options']}, backbone {report['model']}, {report['source_step']} training steps "
             f"({report['source_tokens']} tokens). Conversion: stage 1 {report['stage1_steps']} steps, "
             f"stage 2 {report['sparse_steps']} steps, batch {report['batch_size']}. Wall time "
             f"{report['wall_seconds']:.0f} s.",
             "",
             f"Dense {metric}: " + ", ".join(f"T={length}: {_metric(report['dense'][str(length)], metric)}"
                                             for length in lengths),
             "",
             "| K | seed | " + " | ".join(f"{metric} T={length}" for length in lengths)
             + " | routing recall per layer | stage-1 KL at end | tokens / source's |",
             "|---" * (len(lengths) + 5) + "|"]
    for row in report["rows"]:
        recall = ", ".join("-" if value is None else f"{value:.3f}"
                           for value in row["routing_recall_per_layer"])
        lines.append(f"| {row['topk']} | {row['seed']} | "
                     + " | ".join(_metric(row["quality"][str(length)], metric) for length in lengths)
                     + f" | {recall} | {row['stage1_kl_end']:.4f} | {row['tokens_fraction_of_source']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
