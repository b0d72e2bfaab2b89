"""What one training step and one inference pass of a compare model cost, measured on a freshly
initialised model (the same for every mechanism: only the attention differs) with one thread, as
the training workers run.

`task_costs` measures every mechanism that ran on a task, stored under runs/ like the runs. A
one-stage setup's mechanisms are timed one after another (`measure_alone`: median times over
repetitions, peak memory of a training step, on one training batch), all in one record; a staged
setup's (`compare --long`) each beside `full` in the same rounds, at T and at every evaluation
multiple (`measure_beside_full`), each in its own record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from routeformer.compare.budgets import CompareBudget, layer_options
from routeformer.runner.jobs import cached_run, one_thread, say
from routeformer.runner.setups import TaskSetup
from routeformer.train.on_task import ModelSpec


def task_costs(out: Path, budget: CompareBudget, task: str, setup: TaskSetup,
               runs: dict[str, list[dict[str, Any]]], task_options_of: Callable[[str], dict[str, Any]],
               ) -> dict[str, dict[str, Any]]:
    """The costs of each mechanism in `runs` (its finished records) on `task`, by mechanism; stored
    as `{budget}-{task}-costs-{mechanism}` (staged setup) or `{budget}-{task}-costs-{m1-m2-...}`.
    `task_options_of(mechanism)`: what `build_task` gets for it (its jobs' task options)."""
    name = setup.task_name(task)
    if setup.staged:
        costs = {}
        for mechanism in runs:
            say(f"compare: costs of {mechanism} on {task} (alternating with full)")
            costs[mechanism] = cached_run(out, f"{budget.name}-{task}-costs-{mechanism}",
                                          lambda m=mechanism: measure_beside_full(
                                              name, m, setup, budget.spec, task_options_of, budget.repeats,
                                              trained_routing_shares(runs[m], setup.seq_len)))
        return costs

    def measure_each() -> dict[str, dict[str, Any]]:
        measured: dict[str, dict[str, Any]] = {}
        for mechanism in runs:
            try:
                measured[mechanism] = measure_alone(name, mechanism, setup, budget.spec, budget.repeats,
                                                    task_options_of(mechanism))
            except Exception as error:  # noqa: BLE001 - a cost we could not measure is shown as "-"
                say(f"  costs of {mechanism} on {task} not measured: {type(error).__name__}: {error}")
                measured[mechanism] = {}
        return measured

    return cached_run(out, f"{budget.name}-{task}-costs-{'-'.join(runs)}", measure_each)


def measure_alone(task_name: str, mechanism: str, setup: TaskSetup, spec: ModelSpec, repeats: int,
                  task_options: dict[str, Any]) -> dict[str, float | None]:
    """{"inference_ms", "train_step_ms", "train_step_peak_mib"} of `mechanism` on the task: medians
    over `repeats` on one training batch of the setup's batch size."""
    from routeformer.bench.timing import median_times, peak_memory_mib
    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model

    task = build_task(task_name, **task_options)
    torch.manual_seed(0)
    model = build_task_model(task, mechanism, layer_options(setup, mechanism, task.seq_len), spec)
    inputs, labels = task.batch(setup.schedule.batch_size, torch.Generator().manual_seed(1), "train")
    mask = task.mask(inputs)

    def forward():
        return model(inputs, labels, mask=mask, logits_at_labels=True)

    def inference() -> None:
        with torch.no_grad():
            forward()

    def training_step() -> None:
        model.zero_grad(set_to_none=True)
        forward().total_loss.backward()

    with one_thread():  # as the training workers run; two threads on tiny models only wait
        model.eval()
        inference_s = median_times({"inference": inference}, repeats, warmup=2)["inference"]
        model.train()
        step_s = median_times({"step": training_step}, repeats, warmup=2)["step"]
        peak = peak_memory_mib(training_step)
    return {"inference_ms": 1000 * inference_s, "train_step_ms": 1000 * step_s, "train_step_peak_mib": peak}


def measure_beside_full(
    task_name: str,
    mechanism: str,
    setup: TaskSetup,
    spec: ModelSpec,
    task_options_of: Callable[[str], dict[str, Any]],
    repeats: int,
    routing_shares: tuple[float, ...] | None = None,
) -> dict[str, Any]:
    """Training-step and inference time of `mechanism` and of `full`, alternating in the same rounds
    (one thread, as training ran), at T (training) and at T and every evaluation multiple (inference
    per sequence); the
    ratio is the median of the per-round ratios; peak memory of one training step at T.

    The models are fresh, set to the state they train in at T: past every warm-up and annealing
    (attention.base.skip_schedules), and, for a router whose shares were measured on the trained
    runs (`routing_shares`, meta's tokens per expert: trained_routing_shares), hard-routed at those
    shares — a fresh router would route otherwise (meta's: every expert on every token)."""
    from routeformer.attention import with_baseline
    from routeformer.attention.base import skip_schedules
    from routeformer.bench.timing import peak_memory_mib, ratio_quartiles, round_times
    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model

    def model_for(name: str, task):
        torch.manual_seed(0)
        return build_task_model(task, name, layer_options(setup, name, setup.seq_len), spec)

    with one_thread():
        names = with_baseline([mechanism])  # full, and the mechanism timed against it
        tasks = {name: build_task(task_name, **task_options_of(name)) for name in names}
        models = {name: model_for(name, tasks[name]) for name in names}
        for model in models.values():
            skip_schedules(model, routing_shares)
        batch = setup.schedule.batch_size  # the last stage's
        data = {name: tasks[name].batch(batch, torch.Generator().manual_seed(1), "train") for name in names}

        def step(name: str) -> Callable[[], None]:
            def run() -> None:
                models[name].train()
                models[name].zero_grad(set_to_none=True)
                inputs, labels = data[name]
                models[name](inputs, labels, logits_at_labels=True).total_loss.backward()

            return run

        rounds = round_times({name: step(name) for name in names}, repeats, warmup=1)
        costs: dict[str, Any] = {
            "train_ms_per_step": 1000 * _median(rounds[mechanism]),
            "full_train_ms_per_step": 1000 * _median(rounds["full"]),
            "train_time_vs_full": ratio_quartiles(rounds[mechanism], rounds["full"])[1],
            "peak_mib": peak_memory_mib(step(mechanism)),
            "routing_shares": routing_shares,
            "inference": {},
        }
        for length in setup.lengths:
            batches = {}
            for name in names:
                longer = build_task(task_name, **{**task_options_of(name), "seq_len": length})
                batches[name] = longer.batch(setup.cost_batch, torch.Generator().manual_seed(2), "test")[0]

            def infer(name: str, batches=batches) -> Callable[[], None]:
                def run() -> None:
                    models[name].eval()
                    with torch.no_grad():
                        models[name](batches[name])

                return run

            rounds = round_times({name: infer(name) for name in names}, repeats, warmup=1)
            costs["inference"][str(length)] = {
                "infer_ms_per_seq": 1000 * _median(rounds[mechanism]) / setup.cost_batch,
                "full_infer_ms_per_seq": 1000 * _median(rounds["full"]) / setup.cost_batch,
                "infer_time_vs_full": ratio_quartiles(rounds[mechanism], rounds["full"])[1],
            }
    return costs


ROUTED_ROWS = ("rows_full", "rows_linear", "rows_local")  # meta's share of tokens per expert


def trained_routing_shares(records: list[dict[str, Any]], seq_len: int) -> tuple[float, ...] | None:
    """The mean share of tokens each expert computed at T over the trained runs' tests, where every
    token was hard-routed (hard_fraction ≥ 0.99, so the shares sum to 1); None otherwise."""
    tests = [record["tests"][str(seq_len)] for record in records]
    if not tests or any(t.get("hard_fraction", 0.0) < 0.99 or not set(ROUTED_ROWS) <= set(t) for t in tests):
        return None
    means = [sum(t[key] for t in tests) / len(tests) for key in ROUTED_ROWS]
    return tuple(value / sum(means) for value in means)


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)
