"""`routeformer compare`: every registered mechanism on the same tasks, model size and budget.

Tasks (one model size for all: 2 layers, D=64, 4 heads, MLP ratio 2):
- `lm`: character-level LM at T=256 on the embedded corpus (`--corpus wikitext2` for WikiText-2
  text) — bits per character on the validation split;
- `mqar`: multi-query associative recall at T=512 (16 pairs, vocabulary 256) — query accuracy;
- `listops`: ListOps with short expressions, non-causal — test accuracy.

Every mechanism runs with its defaults, except the budgets that depend on the length T: local
windows T/4, top-k keys T/8, MiTA 16 landmarks of T/8 keys, Meta-Attention's local expert T/4.
`meta_tokens` needs injected meta-tokens, so it runs on `lm` only (density 0.1); on the other
tasks it would be `full` with the same weights.

Per (task, mechanism), all measured in this run: quality; the attention FLOPs the layers
executed per token; the median time of a training step (forward + backward) and of an inference
forward pass on one batch; the peak memory of a training step; the wall-clock of the whole
training run. A layer benchmark times each mechanism's layer (D=256, 4 heads) against `full`
across T. One JSON per finished (task, mechanism) lands in `out/runs/` and LM runs checkpoint as
they train, so a killed compare resumes where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from routeformer.bench.layer_calls import META_DENSITY
from routeformer.experiments.common import log
from routeformer.experiments.report import cached_run, markdown_table, provenance, write_result

TASKS = ("lm", "mqar", "listops")
LM_SEQ_LEN = 256
MQAR_SEQ_LEN = 512
MODEL_DIM = 64
MLP_RATIO = 2.0
MQAR_PAIRS, MQAR_VOCAB = 16, 256  # values come from the upper half of the vocabulary
LM_ONLY = ("meta_tokens",)  # mechanisms that need injected meta-tokens


@dataclass(frozen=True)
class CompareBudget:
    name: str
    lm_steps: int
    mqar_steps: int
    listops_steps: int
    batch_size: int
    mqar_test_sequences: int
    listops_lengths: tuple[int, int]
    listops_examples: tuple[int, int]  # train, test
    bench_lengths: tuple[int, ...]
    repeats: int


QUICK = CompareBudget("quick", lm_steps=150, mqar_steps=60, listops_steps=100, batch_size=8,
                      mqar_test_sequences=128, listops_lengths=(50, 200), listops_examples=(1000, 200),
                      bench_lengths=(256, 1024, 4096), repeats=3)
FULL = CompareBudget("full", lm_steps=600, mqar_steps=600, listops_steps=400, batch_size=16,
                     mqar_test_sequences=1024, listops_lengths=(100, 400), listops_examples=(4000, 500),
                     bench_lengths=(1024, 4096, 16384), repeats=3)


def options_for(mechanism: str, seq_len: int) -> dict[str, Any]:
    """The length-dependent budgets of the module docstring; every other option at its default."""
    if mechanism in ("local", "meta"):  # meta: the window of its local expert
        return {"window": seq_len // 4}
    if mechanism == "topk":
        return {"topk": seq_len // 8}
    if mechanism == "mita":
        return {"landmarks": 16, "topk": seq_len // 8}
    return {}


# The layer benchmark's budgets are fixed, as in the mechanisms' own benches: sparse where T is large.
BENCH_OPTIONS = {"local": {"window": 256}, "meta": {"window": 256}, "topk": {"topk": 64},
                 "mita": {"landmarks": 64, "topk": 64}}


def check_selection(
    mechanisms: Sequence[str] | None, tasks: Sequence[str] | None,
) -> tuple[list[str], list[str]]:
    """Validate --mechanisms / --tasks against the registry; None = all."""
    from routeformer.attention import list_attentions

    registered = list(list_attentions())
    mechanisms = list(mechanisms or sorted(registered, key=lambda name: name != "full"))  # full first
    tasks = list(tasks or TASKS)
    unknown = [m for m in mechanisms if m not in registered]
    if unknown:
        raise ValueError(f"mechanisms: unknown {unknown}; registered: {registered}")
    bad_tasks = [t for t in tasks if t not in TASKS]
    if bad_tasks:
        raise ValueError(f"tasks: unknown {bad_tasks}; valid: {list(TASKS)}")
    if not mechanisms or not tasks:
        raise ValueError("mechanisms and tasks must each name at least one")
    return mechanisms, tasks


def measure_costs(
    model: torch.nn.Module, forward: Callable[[], Any], repeats: int,
) -> dict[str, float | None]:
    """Median inference forward time, median training-step (forward + backward) time and the peak
    memory of a training step, of `forward()` (which returns a ModelOutput with labels)."""
    from routeformer.bench.timing import median_times, peak_memory_mib

    def inference() -> None:
        with torch.no_grad():
            forward()

    def training_step() -> None:
        model.zero_grad(set_to_none=True)
        forward().total_loss.backward()

    model.eval()
    inference_s = median_times({"inference": inference}, repeats)["inference"]
    model.train()
    step_s = median_times({"step": training_step}, repeats)["step"]
    peak = peak_memory_mib(training_step)
    model.zero_grad(set_to_none=True)
    return {"inference_ms": 1000 * inference_s, "train_step_ms": 1000 * step_s, "train_step_peak_mib": peak}


def run_lm(out_dir: Path, mechanism: str, budget: CompareBudget, corpus: str) -> dict[str, Any]:
    from routeformer.data.batches import sequential_batches
    from routeformer.data.corpora import load_corpus
    from routeformer.data.meta_tokens import inject_into_batch, real_tokens_per_window
    from routeformer.experiments.common import run_lm_variant

    density = META_DENSITY if mechanism in LM_ONLY else 0.0

    def costs(result) -> dict[str, Any]:
        ids = result.vocab.encode(load_corpus(corpus).val)
        inputs, labels = next(sequential_batches(ids, budget.batch_size,
                                                 real_tokens_per_window(LM_SEQ_LEN, density)))
        if density > 0:
            inputs, labels = inject_into_batch(inputs, labels, LM_SEQ_LEN, meta_id=result.vocab.pause_id,
                                               density=density, generator=torch.Generator().manual_seed(0))
        return measure_costs(result.model, lambda: result.model(inputs, labels), budget.repeats)

    record = run_lm_variant(out_dir, mechanism, options_for(mechanism, LM_SEQ_LEN), budget.lm_steps, corpus,
                            seq_len=LM_SEQ_LEN, batch_size=budget.batch_size, dim=MODEL_DIM,
                            mlp_ratio=MLP_RATIO, eval_tokens=16384, meta_density=density,
                            after_training=costs)
    return {**record, "quality": record["final"]["bpc"],
            "attention_flops_per_token": record["final"]["attention_flops_per_token"]}


def run_mqar(mechanism: str, budget: CompareBudget) -> dict[str, Any]:
    from routeformer.data.mqar import MQARConfig, mqar_batch
    from routeformer.experiments.topk import run_mqar_variant

    def costs(model, task) -> dict[str, Any]:
        inputs, labels = mqar_batch(task, budget.batch_size, torch.Generator().manual_seed(1))
        return measure_costs(model, lambda: model(inputs, labels, logits_at_labels=True), budget.repeats)

    task = MQARConfig(seq_len=MQAR_SEQ_LEN, pairs=MQAR_PAIRS, vocab_size=MQAR_VOCAB)
    options = options_for(mechanism, MQAR_SEQ_LEN)
    record = run_mqar_variant(MQAR_SEQ_LEN, mechanism, options, budget.mqar_steps, seed=0, eval_sequences=64,
                              test_sequences=budget.mqar_test_sequences, evals=4,
                              task=task, batch_size=budget.batch_size, dim=MODEL_DIM, mlp_ratio=MLP_RATIO,
                              after_training=costs)
    return {**record, "quality": record["final"]["accuracy"]}


def run_listops(mechanism: str, budget: CompareBudget) -> dict[str, Any]:
    from routeformer.data.listops import pad_batch
    from routeformer.experiments.mita import run_listops_variant

    def costs(model, test_examples) -> dict[str, Any]:
        tokens, mask, labels = pad_batch(test_examples[:budget.batch_size])
        return measure_costs(model, lambda: model(tokens, labels, mask=mask), budget.repeats)

    low, high = budget.listops_lengths
    settings = {"min_length": low, "max_length": high, "train": budget.listops_examples[0],
                "test": budget.listops_examples[1], "steps": budget.listops_steps,
                "batch_size": budget.batch_size}
    record = run_listops_variant(mechanism, options_for(mechanism, high), settings, seed=0,
                                 after_training=costs)
    return {**record, "quality": record["accuracy"]}


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
                     f"({row['forward_vs_full']:.2f}x full), fwd+bwd {row['fwd_bwd_ms']:.1f} ms "
                     f"({row['fwd_bwd_vs_full']:.2f}x)")
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


def pareto_front(points: dict[str, tuple[float, float]], higher_is_better: bool) -> set[str]:
    """Names not dominated by another point with fewer (or equal) FLOPs and better (or equal)
    quality, one of them strictly. points: name -> (flops, quality)."""
    def better_or_equal(a: float, b: float) -> bool:
        return a >= b if higher_is_better else a <= b

    front = set()
    for name, (flops, quality) in points.items():
        dominated = any(
            other != name and f <= flops and better_or_equal(q, quality) and (f < flops or q != quality)
            for other, (f, q) in points.items())
        if not dominated:
            front.add(name)
    return front


TASK_QUALITY = {"lm": ("bits/char", False), "mqar": ("accuracy", True), "listops": ("accuracy", True)}


def run_compare(
    out_dir: str | Path = "runs/compare", *, mechanisms: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None, quick: bool = False, corpus: str = "pydoc", bench: bool = True,
    budget: CompareBudget | None = None,
) -> Path:
    """Run the comparison described in the module docstring; returns the report's path.
    `budget` overrides the QUICK / FULL presets (tests run a toy one)."""
    from routeformer.data.corpora import load_corpus

    mechanisms, tasks = check_selection(mechanisms, tasks)
    budget = budget or (QUICK if quick else FULL)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus_name = load_corpus(corpus).name if "lm" in tasks else None
    jobs = [(task, m) for task in tasks for m in mechanisms if task == "lm" or m not in LM_ONLY]
    records: dict[str, dict[str, dict[str, Any]]] = {task: {} for task in tasks}
    began = time.perf_counter()
    for index, (task, mechanism) in enumerate(jobs, 1):
        # The budget and corpus are part of the key: a quick run never reuses a full run's record.
        key = f"{budget.name}-{task}-{mechanism}" + (f"-{corpus.replace(':', '_').replace('/', '_')}"
                                                     if task == "lm" else "")
        log(f"compare [{index}/{len(jobs)}] {task} / {mechanism} "
            f"({time.perf_counter() - began:.0f} s elapsed)")
        records[task][mechanism] = cached_run(
            out, key, lambda task=task, mechanism=mechanism, key=key: _run_job(
                task, mechanism, budget, corpus, out / "train" / key))
        record = records[task][mechanism]
        log(f"  {task} / {mechanism}: {TASK_QUALITY[task][0]} {record['quality']:.4g}, "
            f"{record['attention_flops_per_token']:.3g} attention FLOPs/token, trained in "
            f"{record['train_seconds']:.0f} s")
    bench_rows = []
    if bench:
        log(f"compare: layer benchmark at T = {list(budget.bench_lengths)}")
        bench_rows = cached_run(out, f"{budget.name}-bench-{'-'.join(mechanisms)}", lambda: {
            "rows": bench_layers(mechanisms, budget.bench_lengths, budget.repeats)})["rows"]
    log(f"compare: done in {time.perf_counter() - began:.0f} s")
    every_mechanism = set(check_selection(None, None)[0])
    command = "routeformer compare" + "".join([
        " --quick" if quick else "",
        f" --tasks {' '.join(tasks)}" if tasks != list(TASKS) else "",
        f" --mechanisms {' '.join(mechanisms)}" if set(mechanisms) != every_mechanism else "",
        f" --corpus {corpus}" if corpus != "pydoc" else "", "" if bench else " --no-bench"])
    return write_compare_report(out, records, bench_rows, budget, corpus_name, command)


def _run_job(
    task: str, mechanism: str, budget: CompareBudget, corpus: str, train_dir: Path,
) -> dict[str, Any]:
    if task == "lm":
        return run_lm(train_dir, mechanism, budget, corpus)
    return run_mqar(mechanism, budget) if task == "mqar" else run_listops(mechanism, budget)


def write_compare_report(
    out: Path, records: dict[str, dict[str, dict[str, Any]]], bench_rows: list[dict[str, Any]],
    budget: CompareBudget, corpus_name: str | None, command: str,
) -> Path:
    from routeformer.experiments.report import line_plot, scatter_plot

    sections = [
        "# routeformer compare",
        provenance(command) + " Step times, inference times and memory were measured right after each "
        "run trained; the date is when this report was written.",
        f"Budget `{budget.name}`: one model size for every mechanism (2 layers, D={MODEL_DIM}, 4 heads, "
        f"MLP ratio {MLP_RATIO}), batch {budget.batch_size}, AdamW; LM {budget.lm_steps} steps at "
        f"T={LM_SEQ_LEN} on {corpus_name}; MQAR {budget.mqar_steps} steps at T={MQAR_SEQ_LEN} "
        f"({MQAR_PAIRS} pairs, vocabulary {MQAR_VOCAB}); ListOps {budget.listops_steps} steps on "
        f"{budget.listops_lengths[0]}-{budget.listops_lengths[1]}-token expressions. One seed. "
        "Local windows T/4, top-k T/8 keys, "
        "MiTA 16 landmarks of T/8 keys; `meta_tokens` runs on the LM only (meta-token density 0.1). "
        "FLOPs: attention FLOPs the layers executed, per token. Step and inference times are medians "
        f"of {budget.repeats} repetitions on one batch; peak MiB is the extra memory of one training step. "
        "★ marks the Pareto front of quality against executed FLOPs.",
    ]
    summary: dict[str, Any] = {"budget": asdict(budget), "corpus": corpus_name, "tasks": {}}
    for task, by_mechanism in records.items():
        label, higher_is_better = TASK_QUALITY[task]
        points = {m: (r["attention_flops_per_token"], r["quality"]) for m, r in by_mechanism.items()}
        front = pareto_front(points, higher_is_better)
        full_flops = by_mechanism.get("full", {}).get("attention_flops_per_token")
        rows, table = [], []
        for mechanism, r in by_mechanism.items():
            row = {"mechanism": mechanism, "quality": r["quality"],
                   "flops_per_token": r["attention_flops_per_token"],
                   "flops_vs_full": r["attention_flops_per_token"] / full_flops if full_flops else None,
                   "train_step_ms": r["train_step_ms"], "inference_ms": r["inference_ms"],
                   "train_step_peak_mib": r["train_step_peak_mib"], "train_seconds": r["train_seconds"],
                   "pareto": mechanism in front}
            rows.append(row)
            table.append([("★ " if row["pareto"] else "") + mechanism, row["quality"], row["flops_per_token"],
                          "-" if row["flops_vs_full"] is None else row["flops_vs_full"], row["train_step_ms"],
                          row["inference_ms"], "-" if row["train_step_peak_mib"] is None
                          else row["train_step_peak_mib"], round(row["train_seconds"], 1)])
        summary["tasks"][task] = rows
        scatter_plot(out / f"pareto_{task}.png", points, front, xlabel="attention FLOPs per token (executed)",
                     ylabel=label, title=f"{task}: quality vs executed attention FLOPs")
        sections += [f"## {task}", markdown_table(
            ["mechanism", label, "FLOPs/token", "vs full", "train step ms", "inference ms", "peak MiB",
             "train s"], table), f"Plot: `pareto_{task}.png`."]
        if task in ("mqar", "listops"):
            sections.append(_chance_note(task, by_mechanism))
    if bench_rows:
        summary["bench"] = bench_rows
        mechanisms = list(dict.fromkeys(row["mechanism"] for row in bench_rows))
        for key, name, ylabel in (("fwd_bwd_ms", "bench_time.png", "forward + backward ms"),
                                  ("fwd_bwd_peak_mib", "bench_memory.png", "peak MiB (forward + backward)")):
            line_plot(out / name, {m: ([r["T"] for r in bench_rows if r["mechanism"] == m],
                                       [r[key] or 0.0 for r in bench_rows if r["mechanism"] == m])
                                   for m in mechanisms},
                      xlabel="T", ylabel=ylabel, title=f"layer {ylabel} vs T (D=256, 4 heads, B=1)",
                      logx=True, logy=key == "fwd_bwd_ms")
        sections += ["## Layer time and memory vs T", (
            "Causal layers (projections included), D=256, 4 heads, B=1; local and Meta-Attention windows "
            "256, top-k 64 keys, MiTA 64 landmarks of 64 keys, meta-token density 0.1; ratios against `full` "
            "(SDPA) in "
            "the same rounds; forward in eval mode without gradients, forward + backward in train mode."),
            markdown_table(["T", "mechanism", "forward ms", "vs full", "fwd+bwd ms", "vs full", "peak MiB"],
                           [[r["T"], r["mechanism"], r["forward_ms"], r["forward_vs_full"], r["fwd_bwd_ms"],
                             r["fwd_bwd_vs_full"], "-" if r["fwd_bwd_peak_mib"] is None
                             else r["fwd_bwd_peak_mib"]] for r in bench_rows]),
            "Plots: `bench_time.png`, `bench_memory.png`."]
    return write_result(out, summary, "\n\n".join(sections) + "\n")


def _chance_note(task: str, by_mechanism: dict[str, dict[str, Any]]) -> str:
    majority = max(r.get("majority_accuracy", 0.0) for r in by_mechanism.values())
    values = MQAR_VOCAB // 2
    chance = 1 / values if task == "mqar" else majority
    best = max(r["quality"] for r in by_mechanism.values())
    what = f"guessing among the {values} values" if task == "mqar" else "always answering the majority class"
    if best <= chance + 0.02:
        return (f"No mechanism learned {task} at this budget: the best accuracy ({best:.3f}) is within "
                f"0.02 of {what} ({chance:.3f}); this table compares costs, not quality.")
    return f"Best accuracy {best:.3f}; {what}: {chance:.3f}."
