"""`routeformer reproduce topk-*`: ADSR top-k routed attention.

- topk-previous-token, topk-position-lm: the position-aware router (3 seeds each, test split).
- topk-routing-learning (topk_routing_learning.py): distill / score_bias / none and the
  position-blind router on compare --quick's MQAR and char LM, 3 seeds, chosen on validation.
- topk-speed: the `bench topk` suite (time and peak memory of the topk op vs SDPA) as a report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routeformer.experiments.registry import register_experiment
from routeformer.runner.jobs import Job, finished_records, run_jobs, run_key, say
from routeformer.runner.report import line_plot, markdown_table, mean_sd, provenance, write_result
from routeformer.runner.seeds import over_seeds, seed_grid
from routeformer.runner.setups import TaskSetup
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule


@register_experiment("topk-speed", "topk op vs SDPA: forward and forward+backward time, peak memory")
def speed(out_dir: Path, quick: bool) -> Path:
    from routeformer.bench.ops_bench import TABLE_HEADER, bench_ops, format_row, rows_as_dicts
    from routeformer.bench.topk_bench import topk_op_table

    lengths = [1024, 4096] if quick else [1024, 4096, 16384, 65536]
    repeats = 3
    rows = bench_ops(lengths, repeats=repeats, ops=topk_op_table(1, 4, 16, 64), backward_up_to=16384,
                     progress=say)
    default = "topk(K=64,r=16)"  # the default implementation (native kernels where available)
    crossover = next((row.length for row in rows if row.impl == default and row.forward_speedup > 1.0),
                     None)
    markdown = "\n\n".join([
        "# topk-speed: top-k routed attention vs SDPA",
        provenance(f"routeformer reproduce topk-speed{' --quick' if quick else ''}"),
        f"Causal, B=1, H=4, d=64, routing dim 16, K=64, fp32. Medians of {repeats} alternating "
        "repetitions; speedup = SDPA time / topk time in the same process; lengths above 16384 "
        "are timed forward only. Peak MiB = extra resident memory of one call. `topk` runs the "
        "fused C kernels of ops/native (routing, attention forward and backward) when a C "
        "compiler is present; `torch ops` is the same op in PyTorch alone.",
        TABLE_HEADER + "\n" + "\n".join(format_row(row) for row in rows),
        "Forward crossover (first measured length where topk beats SDPA): "
        + (str(crossover) if crossover else "none among the measured lengths") + ".",
    ])
    line_plot(out_dir / "speed.png", {
        impl: ([r.length for r in rows if r.impl == impl], [r.forward_ms for r in rows if r.impl == impl])
        for impl in dict.fromkeys(r.impl for r in rows)
    }, xlabel="T", ylabel="forward ms", title="topk vs SDPA (forward)", logx=True, logy=True)
    return write_result(out_dir, {"rows": rows_as_dicts(rows), "forward_crossover": crossover}, markdown)


# -- the positional routing probe -------------------------------------------------------------------
ROUTING_POSITIONS = ("none", "rotary", "recency", "rotary+recency")


def routing_position_variants(k: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """full, and topk with K keys under each router position mode."""
    topk = {f"topk(K={k},positions={mode})": ("topk", {"topk": k, "routing_positions": mode})
            for mode in ROUTING_POSITIONS}
    return {"full": ("full", {}), **topk}


PREVIOUS_TOKEN_VARIANTS = routing_position_variants(8)


def _seeded_variants(
    out_dir: Path, task: str, variants: dict[str, tuple[str, dict[str, Any]]],
    seeds: tuple[int, ...], setup: TaskSetup, spec: ModelSpec, metric: str,
) -> tuple[dict[str, Any], list[list[str]]]:
    """Train every variant on `task` with every seed, as one `run_jobs` sweep (records stored per run
    in `out_dir/runs/`, one thread each); per variant the test `metric` per seed, mean and sd, and
    Markdown rows. Raises RuntimeError naming the runs that failed."""
    names = {run_key(name): name for name in variants}
    jobs = [Job(f"{key}-seed{seed}", task, dict(setup.options), *variants[names[key]], seed, setup, spec)
            for key, seed in seed_grid(list(names), seeds)]
    records = finished_records(run_jobs(out_dir, jobs, 1, say), f"topk on {task}")
    result, rows = {}, []
    for key, name in names.items():
        values = over_seeds(lambda seed, key=key: records[f"{key}-seed{seed}"]["test"][metric], seeds)
        mean, spread = mean_sd(values)
        result[name] = {metric: values, "mean": mean, "sd": spread}
        rows.append([name, f"{mean:.3f} ± {spread:.3f}", ", ".join(f"{v:.3f}" for v in values)])
    return result, rows


def _setup(task_options: dict[str, Any], steps: int, batch_size: int, test_sequences: int) -> TaskSetup:
    """One stage of `steps` at lr 3e-3 (a tenth of them warm-up), one evaluation at its end."""
    schedule = Schedule(steps=steps, batch_size=batch_size, lr=3e-3, warmup_steps=steps // 10)
    return TaskSetup(task_options, schedule, eval_every=steps, test_sequences=test_sequences)


@register_experiment("topk-previous-token", "previous-token copying, 1-layer rotary model: topk K=8 with "
                     "no forced keys, router blind to position vs rotary vs recency routing, vs full")
def previous_token(out_dir: Path, quick: bool) -> Path:
    """Can the router prefer nearby keys? K=8, local_window=0, global_tokens=0, so key i-1 is read
    only if the router ranks it among the top 8 of up to 64 keys; test accuracy, 3 seeds."""
    from routeformer.tasks import build_task

    steps, seeds = (100, (0,)) if quick else (300, (0, 1, 2))
    options = {"seq_len": 64, "vocab_size": 32}
    task = build_task("previous_token", **options)
    spec = ModelSpec(dim=64, depth=1, heads=2, positions="rotary")
    variants, rows = _seeded_variants(out_dir, "previous_token", PREVIOUS_TOKEN_VARIANTS, seeds,
                                      _setup(options, steps, 64, 1024), spec, "accuracy")
    result = {"task": task.describe(), "model": spec.__dict__, "steps": steps, "variants": variants}
    command = "routeformer reproduce topk-previous-token" + (" --quick" if quick else "")
    markdown = "\n\n".join([
        "# topk-previous-token: can top-k routing prefer nearby keys?",
        f"Task: previous_token, T=64, vocabulary 32 (chance {task.chance:.3f}). Model: 1 layer, D=64, "
        f"2 heads, rotary positions; {steps} steps of batch 64, AdamW lr 3e-3, {steps // 10} warm-up "
        "steps. topk: K=8, local_window=0, global_tokens=0, routing_learning='distill'. "
        f"Test accuracy, mean ± sd over seeds {', '.join(map(str, seeds))}.",
        markdown_table(["variant", "test accuracy", "per seed"], rows),
        provenance(command),
    ])
    return write_result(out_dir, result, markdown + "\n")


POSITION_LM_VARIANTS = routing_position_variants(16)


@register_experiment("topk-position-lm", "char-LM (pydoc, T=128) at compare's quick budget: the gap of "
                     "topk K=16 to full with a position-blind, rotary and recency router, 3 seeds")
def position_lm(out_dir: Path, quick: bool) -> Path:
    """The budget of `routeformer compare --quick`'s LM row (2 layers, D=64, 2 heads, rotary,
    300 steps of batch 32 at T=128, K = T/8); bits per character on 256 test sequences."""
    from routeformer.tasks import build_task

    steps, seeds = (60, (0,)) if quick else (300, (0, 1, 2))
    options = {"corpus": "pydoc", "seq_len": 128}
    task = build_task("lm", **options)
    spec = ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary")
    variants, rows = _seeded_variants(out_dir, "lm", POSITION_LM_VARIANTS, seeds,
                                      _setup(options, steps, 32, 256), spec, task.metric)
    full = variants["full"]["mean"]
    for row, name in zip(rows, variants, strict=True):
        row.append(f"{variants[name]['mean'] - full:+.3f}")
    result = {"task": task.describe(), "model": spec.__dict__, "steps": steps, "variants": variants}
    command = "routeformer reproduce topk-position-lm" + (" --quick" if quick else "")
    markdown = "\n\n".join([
        "# topk-position-lm: does a position-aware router close topk's char-LM gap?",
        f"Task: char LM on pydoc, T=128. Model: 2 layers, D=64, 2 heads, MLP ratio 2, rotary positions; "
        f"{steps} steps of batch 32, AdamW lr 3e-3, {steps // 10} warm-up steps (compare's quick budget). "
        f"topk: K=16, routing_learning='distill'. Test {task.metric} (256 sequences), mean ± sd over seeds "
        f"{', '.join(map(str, seeds))}.",
        markdown_table(["variant", f"test {task.metric}", "per seed", "gap to full"], rows),
        provenance(command),
    ])
    return write_result(out_dir, result, markdown + "\n")

