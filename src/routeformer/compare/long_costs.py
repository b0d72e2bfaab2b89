"""What a mechanism costs at the long budget's lengths, measured beside `full` in the same rounds:
training-step time at T, inference time per sequence at T, 2T and 4T, peak memory of a step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from routeformer.compare.long_budget import EVAL_MULTIPLES, LongSetup
from routeformer.train.on_task import ModelSpec


def measure_long_costs(
    task_name: str,
    mechanism: str,
    setup: LongSetup,
    spec: ModelSpec,
    task_options_of: Callable[[str], dict[str, Any]],
    repeats: int,
    routing_shares: tuple[float, ...] | None = None,
) -> dict[str, Any]:
    """Training-step and inference time of `mechanism` and of `full`, alternating in the same rounds
    (one thread, as training ran), at T (training) and at T, 2T, 4T (inference per sequence); the
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
        return build_task_model(task, name, setup.options_for(name), spec)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        names = with_baseline([mechanism])  # full, and the mechanism timed against it
        tasks = {name: build_task(task_name, **task_options_of(name)) for name in names}
        models = {name: model_for(name, tasks[name]) for name in names}
        for model in models.values():
            skip_schedules(model, routing_shares)
        batch = setup.stages[-1].schedule.batch_size
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
        for multiple in (1, *EVAL_MULTIPLES):
            length = setup.seq_len * multiple
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
    finally:
        torch.set_num_threads(threads)
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
