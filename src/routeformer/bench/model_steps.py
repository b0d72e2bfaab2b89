"""`routeformer bench steps`: a whole model's training step (forward + backward) per mechanism,
against `full` in the same rounds, at several lengths with the same tokens per step.

What a user training a model pays: the layers, their routing and auxiliary losses, the MLPs, the
embedding and the loss, on one thread (as compare's training jobs run). The model is the one the
caller gives (compare --long's by default: 2 layers, D=64, 2 heads, rotary); the task is compare
--long's recall (MQAR, 7 pairs, vocabulary 16) at each length, batch = tokens // T, so every
length does the same number of token-steps. Each round runs every mechanism once, alternating
order (bench/timing.round_times); the ratio is the median of the per-round ratios to full; peak
memory is the step's extra resident memory.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from routeformer.attention import with_baseline
from routeformer.bench.timing import peak_memory_mib, ratio_quartiles, round_times

STEP_TASK = {"pairs": 7, "vocab_size": 16}  # compare --long's recall, at every timed length


def model_step_rows(
    mechanisms: list[str], lengths: list[int], *, options_for: Callable[[str, int], dict[str, Any]],
    spec: Any, tokens: int = 8192, repeats: int = 5, threads: int = 1,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (length, mechanism): ms per training step, its ratio to full's (median and
    quartiles of the per-round ratios) and peak MiB. `options_for(mechanism, T)` gives each layer's
    options at T (compare's budgets); `spec` is a train.on_task.ModelSpec; `prepare(model)`, if
    given, runs on every built model before timing (e.g. to fix a router's shares)."""
    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model

    if not mechanisms:
        raise ValueError("mechanisms: name at least one mechanism to time against full")
    if tokens < max(lengths):
        raise ValueError(f"tokens must be >= the longest length {max(lengths)} (one sequence); got {tokens}")
    names = with_baseline(dict.fromkeys(mechanisms))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for length in lengths:
            task = build_task("mqar", seq_len=length, **STEP_TASK)
            batch = max(1, tokens // length)
            inputs, labels = task.batch(batch, torch.Generator().manual_seed(1), "train")
            models = {}
            for name in names:
                torch.manual_seed(0)
                models[name] = build_task_model(task, name, options_for(name, length), spec).train()
                if prepare is not None:
                    prepare(models[name])

            step = {name: _training_step(models[name], inputs, labels) for name in names}
            times = round_times(step, repeats, warmup=1)
            for name in names:
                low, median, high = ratio_quartiles(times[name], times["full"])
                row = {"seq_len": length, "batch": batch, "mechanism": name,
                       "options": options_for(name, length),
                       "ms_per_step": 1000 * statistics.median(times[name]),
                       "vs_full": median, "vs_full_quartiles": [low, high],
                       "peak_mib": peak_memory_mib(step[name])}
                rows.append(row)
                if progress is not None:
                    progress(format_step_row(row))
    finally:
        torch.set_num_threads(previous)
    return rows


STEP_HEADER = ("| T | batch | mechanism | ms / step | × full (quartiles) | peak MiB |\n"
               "|---|---|---|---|---|---|")


def _training_step(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(inputs, labels, logits_at_labels=True).total_loss.backward()
    return run


def format_step_row(row: dict[str, Any]) -> str:
    low, high = row["vs_full_quartiles"]
    peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
    return (f"| {row['seq_len']} | {row['batch']} | {row['mechanism']} | {row['ms_per_step']:.1f} | "
            f"{row['vs_full']:.2f} ({low:.2f}-{high:.2f}) | {peak} |")
