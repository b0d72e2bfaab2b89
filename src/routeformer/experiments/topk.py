"""`routeformer reproduce topk-*`: ADSR top-k routed attention (issue: topk).

- topk-previous-token, topk-position-lm: the position-aware router (3 seeds each, test split).
- topk-routing-learning (topk_routing_learning.py): distill / score_bias / none and the
  position-blind router on compare --quick's MQAR and char LM, 3 seeds, chosen on validation.
- topk-speed: time and peak memory of the topk op vs SDPA (also `routeformer bench topk`).
- topk-mqar, topk-mqar-small (MQAR, one seed per cell), topk-lm (char LM at T = 512, one seed):
  their earlier results are withdrawn (old MQAR generator, single seeds; docs/results/topk.md);
  the commands still run, on `routeformer.tasks`' MQAR, and have not been re-run since.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from routeformer.experiments.common import lm_comparison, run_key
from routeformer.experiments.common import log as _log
from routeformer.experiments.registry import register_experiment
from routeformer.experiments.report import (
    cached_run,
    line_plot,
    markdown_table,
    provenance,
    write_result,
)
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.tasks.mqar import MQAR
from routeformer.train.task_loop import TaskTrainConfig, layer_stat, train_task

MQAR_PAIRS = {256: 16, 512: 32, 1024: 64}
MQAR_DIM = 64
LOCAL_WINDOW = 64


def _controls_and_topk(window: int, ks: tuple[int, ...]) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (mechanism, options): full, local(window), linear, then topk at each K with each
    routing-learning option."""
    variants: dict[str, tuple[str, dict[str, Any]]] = {
        "full": ("full", {}), f"local(w={window})": ("local", {"window": window}), "linear": ("linear", {}),
    }
    for k in ks:
        for learning in ("score_bias", "distill", "none"):
            variants[f"topk(K={k},{learning})"] = ("topk", {"topk": k, "routing_learning": learning})
    return variants


def mqar_variants(length: int, quick: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """The full grid at the shortest length, the K = 32 row beyond."""
    ks = (32,) if quick else ((8, 32, 64) if length == 256 else (32,))
    return _controls_and_topk(LOCAL_WINDOW, ks)


def mqar_accuracy(
    model: CausalLM, task: MQAR, sequences: int, seed: int, split: str = "test",
) -> dict[str, float]:
    generator = torch.Generator().manual_seed(seed)
    correct = total = 0
    recalls = []
    with torch.no_grad():
        for _ in range(max(1, sequences // 64)):
            inputs, labels = task.batch(64, generator, split)
            result = model(inputs, labels, logits_at_labels=True)
            correct += int((result.logits.argmax(-1) == labels[labels >= 0]).sum())
            total += int((labels >= 0).sum())
            recall = layer_stat(result.stats, "routing_recall")
            if recall is not None:
                recalls.append(recall)
    record = {"accuracy": correct / total}
    if recalls:
        record["routing_recall"] = sum(recalls) / len(recalls)
    return record


def run_mqar_variant(
    length: int, mechanism: str, options: dict, steps: int, seed: int, *, eval_sequences: int = 256,
    test_sequences: int = 1024, task: MQAR | None = None, batch_size: int = 32, dim: int = MQAR_DIM,
    mlp_ratio: float = 4.0, after_training: Callable[[CausalLM, MQAR], dict[str, Any]] | None = None,
    evals: int = 8,
) -> dict[str, Any]:
    """Train and test one MQAR model (2 layers, 4 heads, learned positions). `task` defaults to
    the experiment's (MQAR_PAIRS[length] pairs, vocabulary 8192); `after_training(model, task)`
    adds its own entries to the record; `evals` evaluations on `eval_sequences` during training."""
    task = task or MQAR(seq_len=length, pairs=MQAR_PAIRS[length], vocab_size=8192)
    config = ModelConfig(vocab_size=task.vocab_size, dim=dim, depth=2, heads=4, mlp_ratio=mlp_ratio,
                         attention=mechanism, attention_options={mechanism: options} if options else {},
                         positions="learned", max_seq_len=length, tie_embeddings=False)
    torch.manual_seed(seed)
    model = CausalLM(config)
    train_config = TaskTrainConfig(steps=steps, batch_size=batch_size, lr=1e-3,
                                   eval_every=max(1, steps // evals), seed=seed)
    history = train_task(
        model, lambda batch, gen: task.batch(batch, gen, "train"),
        lambda m: mqar_accuracy(m, task, eval_sequences, seed=10_000 + seed, split="validation"),
        train_config,
        forward=lambda m, inputs, labels: m(inputs, labels, logits_at_labels=True),
        log=lambda line: _log(f"  mqar T={length} {mechanism} {options}: {line}"),
    )
    final = mqar_accuracy(model, task, test_sequences, seed=20_000 + seed)
    with torch.no_grad():
        inputs, _ = task.batch(8, torch.Generator().manual_seed(1), "test")
        flops = sum(float(s["flops"]) for s in model.eval().backbone(inputs).stats) / inputs.numel()
    record = {"length": length, "mechanism": mechanism, "options": options, "steps": steps,
              "history": history.evals, "final": final, "train_seconds": history.train_seconds,
              "attention_flops_per_token": flops}
    if after_training is not None:
        record.update(after_training(model, task))
    return record


@dataclass(frozen=True)
class MQARGrid:
    """One MQAR experiment: the tasks per length, the training budget and the variants per length."""
    tasks: dict[int, MQAR]
    steps: int
    batch_size: int
    variants: Callable[[int], dict[str, tuple[str, dict[str, Any]]]]
    note: str


def _paper_grid(quick: bool) -> MQARGrid:
    lengths = [256] if quick else [256, 512, 1024]
    return MQARGrid(
        tasks={n: MQAR(seq_len=n, pairs=MQAR_PAIRS[n], vocab_size=8192) for n in lengths},
        steps=300 if quick else 1500, batch_size=32,
        variants=lambda length: mqar_variants(length, quick),
        note="the issue's setting (vocabulary 8192)")


SMALL_MQAR = MQAR(seq_len=64, pairs=8, vocab_size=64)


def small_mqar_variants(length: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """The controls (local window T/4) and top-k at K = T/8 with each routing-learning option."""
    return _controls_and_topk(length // 4, (length // 8,))


def _small_grid(quick: bool) -> MQARGrid:
    return MQARGrid(
        tasks={SMALL_MQAR.seq_len: SMALL_MQAR}, steps=400 if quick else 2000, batch_size=64,
        variants=small_mqar_variants,
        note=("a CPU-sized task that full attention does learn within the budget (T = 64, 8 pairs, "
              "vocabulary 64: 32 keys, 32 values, chance 1/32), to compare the routing-learning "
              "options where the issue's setting learns nothing at CPU budgets"))


@register_experiment("topk-mqar", "multi-query associative recall: full/local/linear/topk, accuracy "
                     "and routing recall over training")
def mqar(out_dir: Path, quick: bool) -> Path:
    return _run_mqar_grid(out_dir, "topk-mqar", quick, _paper_grid(quick))


@register_experiment("topk-mqar-small", "MQAR at T=64, vocabulary 64 (learnable on a CPU): the "
                     "routing-learning options of topk against full/local/linear")
def mqar_small(out_dir: Path, quick: bool) -> Path:
    return _run_mqar_grid(out_dir, "topk-mqar-small", quick, _small_grid(quick))


def _run_mqar_grid(out_dir: Path, name: str, quick: bool, grid: MQARGrid) -> Path:
    records = {}
    for length, task in grid.tasks.items():
        for variant, (mechanism, options) in grid.variants(length).items():
            key = run_key(f"T{length}-{variant}")
            _log(f"{name}: {key}")
            records[(length, variant)] = cached_run(
                out_dir, key,
                lambda length=length, task=task, mechanism=mechanism, options=options:
                    run_mqar_variant(length, mechanism, options, grid.steps, seed=0, task=task,
                                     batch_size=grid.batch_size),
            )
    rows, curves_acc, curves_recall = [], {}, {}
    for (length, variant), record in records.items():
        final = record["final"]
        rows.append([length, grid.tasks[length].pairs, variant, final["accuracy"],
                     final.get("routing_recall", "-"), record["attention_flops_per_token"],
                     round(record["train_seconds"], 1)])
        steps_axis = [e["step"] for e in record["history"]]
        curves_acc[f"T={length} {variant}"] = (steps_axis, [e["accuracy"] for e in record["history"]])
        if "routing_recall" in final:
            curves_recall[f"T={length} {variant}"] = (
                steps_axis, [e["routing_recall"] for e in record["history"]]
            )
    line_plot(out_dir / "mqar_accuracy.png", curves_acc, xlabel="step", ylabel="query accuracy",
              title=f"{name}: accuracy over training")
    line_plot(out_dir / "mqar_routing_recall.png", curves_recall, xlabel="step",
              ylabel="routing recall (dense attention mass inside R_i)", title=f"{name}: topk routing recall")
    vocab = sorted({task.vocab_size for task in grid.tasks.values()})
    markdown = "\n\n".join([
        f"# {name}: multi-query associative recall",
        provenance(f"routeformer reproduce {name}{' --quick' if quick else ''}"),
        f"Task: {grid.note}. Model: 2 layers, D={MQAR_DIM}, 4 heads, learned positions, vocabulary "
        f"{'/'.join(map(str, vocab))}; {grid.steps} steps of batch {grid.batch_size}, AdamW lr 1e-3; "
        "accuracy on 1024 fresh test sequences (seed 0, one seed per cell). "
        "Routing recall: fraction of the dense attention mass inside the routed set, on 16 sampled "
        "queries per layer, averaged over layers.",
        markdown_table(["T", "pairs", "mechanism", "accuracy", "routing recall", "attention FLOPs/token",
                        "train s"], rows),
        "Plots: `mqar_accuracy.png`, `mqar_routing_recall.png`.",
    ])
    result = {"rows": [dict(zip(["length", "pairs", "mechanism", "accuracy", "routing_recall",
                                 "attention_flops_per_token", "train_seconds"], row, strict=True))
                       for row in rows]}
    return write_result(out_dir, result, markdown)


@register_experiment("topk-speed", "topk op vs SDPA: forward and forward+backward time, peak memory")
def speed(out_dir: Path, quick: bool) -> Path:
    from routeformer.bench.ops_bench import TABLE_HEADER, bench_ops, format_row, rows_as_dicts
    from routeformer.bench.topk_bench import topk_op_table

    lengths = [1024, 4096] if quick else [1024, 4096, 16384, 65536]
    repeats = 3
    rows = bench_ops(lengths, repeats=repeats, ops=topk_op_table(1, 4, 16, 64), backward_up_to=16384,
                     progress=_log)
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


LM_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "full": ("full", {}),
    f"local(w={LOCAL_WINDOW})": ("local", {"window": LOCAL_WINDOW}),
    "topk(K=64,score_bias)": ("topk", {"topk": 64, "routing_learning": "score_bias"}),
    "topk(K=64,distill)": ("topk", {"topk": 64, "routing_learning": "distill"}),
}


@register_experiment("topk-lm", "char-level LM on WikiText-2 text at T=512: topk vs full vs local")
def lm(out_dir: Path, quick: bool) -> Path:
    steps = 60 if quick else 600
    return lm_comparison(
        out_dir, "topk-lm", LM_VARIANTS, steps, quick=quick,
        title="# topk-lm: character-level LM at T = 512",
        description=f"Model: 2 layers, D=128, 4 heads, rotary positions; {steps} steps of batch 16 x 512, "
        "AdamW lr 3e-3, one seed. Bits per character on the whole evaluation split. Attention FLOPs are "
        "those executed (topk at T=512 runs its dense masked path: `dense_below`).")


# -- the positional routing probe (issue 25) ----------------------------------------------------
ROUTING_POSITIONS = ("none", "rotary", "recency", "rotary+recency")


def routing_position_variants(k: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """full, and topk with K keys under each router position mode."""
    topk = {f"topk(K={k},positions={mode})": ("topk", {"topk": k, "routing_positions": mode})
            for mode in ROUTING_POSITIONS}
    return {"full": ("full", {}), **topk}


PREVIOUS_TOKEN_VARIANTS = routing_position_variants(8)


def _seeded_variants(
    out_dir: Path, task, variants: dict[str, tuple[str, dict[str, Any]]], seeds: tuple[int, ...],
    train_for: Callable[[int], TaskTrainConfig], spec, metric: str, test_sequences: int = 1024,
) -> tuple[dict[str, Any], list[list[str]]]:
    """Train every variant on `task` with every seed (records cached per run); per variant the
    test `metric` per seed, mean and sd, and Markdown rows."""
    from statistics import mean, stdev

    from routeformer.train.on_task import train_on_task

    result, rows = {}, []
    for name, (mechanism, options) in variants.items():
        values = []
        for seed in seeds:
            record = cached_run(out_dir, f"{run_key(name)}-seed{seed}", lambda: train_on_task(
                task, mechanism, options, seed=seed, train=train_for(seed), spec=spec,  # noqa: B023
                test_sequences=test_sequences))
            values.append(record["test"][metric])
            _log(f"{name} seed {seed}: test {metric} {values[-1]:.4f}")
        spread = stdev(values) if len(values) > 1 else 0.0
        result[name] = {metric: values, "mean": mean(values), "sd": spread}
        rows.append([name, f"{mean(values):.3f} ± {spread:.3f}", ", ".join(f"{v:.3f}" for v in values)])
    return result, rows


@register_experiment("topk-previous-token", "previous-token copying, 1-layer rotary model: topk K=8 with "
                     "no forced keys, router blind to position vs rotary vs recency routing, vs full")
def previous_token(out_dir: Path, quick: bool) -> Path:
    """Can the router prefer nearby keys? K=8, local_window=0, global_tokens=0, so key i-1 is read
    only if the router ranks it among the top 8 of up to 64 keys; test accuracy, 3 seeds."""
    from routeformer.tasks import build_task
    from routeformer.train.on_task import ModelSpec

    steps, seeds = (100, (0,)) if quick else (300, (0, 1, 2))
    task = build_task("previous_token", seq_len=64, vocab_size=32)
    spec = ModelSpec(dim=64, depth=1, heads=2, positions="rotary")
    variants, rows = _seeded_variants(
        out_dir, task, PREVIOUS_TOKEN_VARIANTS, seeds,
        lambda seed: TaskTrainConfig(steps=steps, batch_size=64, lr=3e-3, warmup_steps=steps // 10,
                                     eval_every=steps, seed=seed), spec, "accuracy")
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
    from routeformer.train.on_task import ModelSpec

    steps, seeds = (60, (0,)) if quick else (300, (0, 1, 2))
    task = build_task("lm", corpus="pydoc", seq_len=128)
    spec = ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary")
    variants, rows = _seeded_variants(
        out_dir, task, POSITION_LM_VARIANTS, seeds,
        lambda seed: TaskTrainConfig(steps=steps, batch_size=32, lr=3e-3, warmup_steps=steps // 10,
                                     eval_every=steps, seed=seed), spec, task.metric, test_sequences=256)
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


# Registers `topk-routing-learning` (its own module: the routing_learning x routing_positions grid).
from routeformer.experiments import topk_routing_learning  # noqa: E402, F401
