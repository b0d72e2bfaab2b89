"""What `routeformer.train.train(config)` returns (runner/lm_config.py trains it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainResult:
    """An LM run trained from its RunConfig as task lm in its run directory.

    `step`: the steps trained; `final_eval`: the test metrics after training, the numbers of the
    record's `test` (`loss`, `bits_per_char`, `attention_flops_per_token`; None on processes other
    than 0 under torchrun);
    `model`, `vocab`: the trained CausalLM and its tokeniser, as `train.checkpoint.load_run_model`
    reads them from `out_dir/checkpoint.pt` (None on processes other than 0); `train_seconds`: the
    training time of the record (without evaluations); `skipped_steps`: the updates the non-finite
    guard skipped (the `skipped` lines of metrics.jsonl); `record`: the run's record.json ({} on
    processes other than 0)."""

    step: int
    final_eval: dict[str, float] | None
    model: Any
    vocab: Any
    out_dir: Path
    train_seconds: float
    skipped_steps: int = 0
    record: dict[str, Any] = field(default_factory=dict)
