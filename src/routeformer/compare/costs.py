"""What one training step and one inference pass of a compare model cost: median times over
alternating repetitions and the peak memory of a training step, measured on one training batch of
the task with a freshly initialised model (the same for every mechanism: only the attention
differs), with one thread, as the training workers run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def measure_task_costs(task_name: str, mechanism: str, setup: Any, spec: Any, repeats: int,
                       task_options: dict[str, Any], options_for: Callable[[str, int], dict[str, Any]],
                       ) -> dict[str, float | None]:
    """{"inference_ms", "train_step_ms", "train_step_peak_mib"} for `mechanism` on the task."""
    from routeformer.bench.timing import median_times, peak_memory_mib
    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model

    task = build_task(task_name, **task_options)
    torch.manual_seed(0)
    model = build_task_model(task, mechanism, options_for(mechanism, task.seq_len), spec)
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

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the training workers run; two threads on tiny models only wait
    try:
        model.eval()
        inference_s = median_times({"inference": inference}, repeats, warmup=2)["inference"]
        model.train()
        step_s = median_times({"step": training_step}, repeats, warmup=2)["step"]
        peak = peak_memory_mib(training_step)
    finally:
        torch.set_num_threads(threads)
    return {"inference_ms": 1000 * inference_s, "train_step_ms": 1000 * step_s, "train_step_peak_mib": peak}
