"""`routeformer reproduce mqar-sweep`: MQAR accuracy against model width, per sequence length and
number of pairs, for every mechanism — the picture Zoology (Arora et al. 2023, Fig. 2) draws for
its architectures, at CPU scale.

The sweep is a list of configs (Zoology's shape): every (T, pairs, width, mechanism, seed) is one
job on `build_task("mqar", seq_len=T, pairs=pairs, vocab_size=...)` with the same backbone except
the width and the attention. Length-dependent options as in `compare` (local T/4, top-k T/8, MiTA
T/8). Accuracy is on the test split; the sweep picks nothing, so there is no validation choice to
keep apart from it. Quick: T = 64 only, 2 widths, 4 mechanisms, 1 seed (a smoke test of the
picture, not a result: one seed separates nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routeformer.compare.budgets import options_for
from routeformer.experiments.registry import register_experiment
from routeformer.runner.jobs import Job, TaskSetup, run_jobs, say
from routeformer.runner.report import line_plot, markdown_table, mean_sd, provenance, write_result
from routeformer.runner.seeds import seed_grid
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule

FULL_GRID = {"lengths": (64, 128, 256), "pairs": (4, 8, 16), "widths": (32, 64, 128), "seeds": 3,
             "steps": 2000, "mechanisms": None}
QUICK_GRID = {"lengths": (64,), "pairs": (4,), "widths": (32, 64), "seeds": 1, "steps": 600,
              "mechanisms": ("full", "linear", "local", "topk")}


def sweep_jobs(grid: dict[str, Any], mechanisms: list[str]) -> list[Job]:
    jobs = []
    for length in grid["lengths"]:
        for pairs in grid["pairs"]:
            if 4 * pairs > length:
                continue
            task_options = {"seq_len": length, "pairs": pairs, "vocab_size": max(64, 4 * pairs)}
            schedule = Schedule(steps=grid["steps"], batch_size=64, lr=3e-3, warmup_steps=grid["steps"] // 10)
            setup = TaskSetup(task_options, schedule, evals=4, test_sequences=512)
            for width in grid["widths"]:
                spec = ModelSpec(dim=width, depth=2, heads=2, mlp_ratio=2.0, positions="rotary")
                for mechanism, seed in seed_grid(mechanisms, range(grid["seeds"]), seed_major=False):
                    jobs.append(Job(f"T{length}-N{pairs}-D{width}-{mechanism}-seed{seed}", "mqar",
                                    task_options, mechanism, options_for(mechanism, length), seed,
                                    setup, spec))
    return jobs


@register_experiment("mqar-sweep", "MQAR accuracy vs model width for T in {64, 128, 256} and growing "
                     "pairs, every mechanism (Zoology's picture at CPU scale)")
def mqar_sweep(out_dir: Path, quick: bool, workers: int = 2) -> Path:
    from routeformer.attention import attention_class, list_attentions

    grid = QUICK_GRID if quick else FULL_GRID
    mechanisms = list(grid["mechanisms"] or [m for m in list_attentions()
                                              if not attention_class(m).needs_meta_tokens])
    jobs = sweep_jobs(grid, mechanisms)
    say(f"mqar-sweep: {len(jobs)} runs")
    records = run_jobs(out_dir, jobs, workers, say)
    cells: dict[tuple[int, int, str], dict[int, list[float]]] = {}
    for job in jobs:
        key = (job.task_options["seq_len"], job.task_options["pairs"], job.mechanism)
        cells.setdefault(key, {}).setdefault(job.spec.dim, []).append(records[job.key]["quality"])
    rows = []
    for (length, pairs, mechanism), by_width in cells.items():
        for width, values in by_width.items():
            rows.append([length, pairs, mechanism, width, *mean_sd(values), len(values)])
    for length, pairs in sorted({(r[0], r[1]) for r in rows}):
        line_plot(out_dir / f"mqar_T{length}_N{pairs}.png",
                  {m: ([r[3] for r in rows if r[:3] == [length, pairs, m]],
                       [r[4] for r in rows if r[:3] == [length, pairs, m]]) for m in mechanisms},
                  xlabel="model width", ylabel="test accuracy",
                  title=f"MQAR T={length}, {pairs} pairs (chance and key-blind rules: 1/{pairs})", logx=True)
    markdown = "\n\n".join([
        "# mqar-sweep: MQAR accuracy against model width",
        provenance(f"routeformer reproduce mqar-sweep{' --quick' if quick else ''}"),
        f"Zoology's MQAR (no answer after a query; values without replacement); 2 layers, 2 heads, rotary, "
        f"MLP ratio 2; {grid['steps']} steps of batch 64, lr 3e-3; {grid['seeds']} seed(s) per cell; test "
        "accuracy on 512 sequences. Every key-blind rule scores 1/pairs (see `routeformer.tasks.mqar`).",
        markdown_table(["T", "pairs", "mechanism", "width", "accuracy (mean)", "sd", "seeds"], rows),
        "Plots: `mqar_T*_N*.png`.",
    ])
    columns = ["seq_len", "pairs", "mechanism", "width", "accuracy", "sd", "seeds"]
    return write_result(out_dir, {"grid": grid, "rows": [dict(zip(columns, r, strict=True)) for r in rows]},
                        markdown)
