"""Where a training run's metrics go: metrics.jsonl always, TensorBoard when asked (`train.logger`).

`RunLog.write(record)` takes the records the loop writes (`{"step": 50, "loss": 1.83, ...}`). Every
record goes to metrics.jsonl (progress.MetricsLog: on resume, records past the checkpoint's step
are dropped first). With `train.logger: tensorboard`, each numeric value of a record is also a
TensorBoard scalar at its step, under `out_dir/tensorboard` (tag `train/loss`, `val/bits_per_char`,
`test/loss`, ...: the `val_` and `test_` prefixes become `val/` and `test/` groups); non-numeric
values (config changes, skipped-step messages) are logged as text. TensorBoard is an optional
extra: `pip install 'routeformer[tensorboard]'`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from routeformer.train.progress import MetricsLog


class RunLog:
    """metrics.jsonl plus, for `logger="tensorboard"`, TensorBoard event files."""

    def __init__(self, out_dir: str | Path, *, resume_step: int | None, logger: str = "jsonl") -> None:
        out_dir = Path(out_dir)
        self.jsonl = MetricsLog(out_dir / "metrics.jsonl", resume_step=resume_step)
        self.writer = None
        if logger == "tensorboard":
            self.writer = _summary_writer(out_dir / "tensorboard", purge_step=resume_step)
        elif logger != "jsonl":
            raise ValueError(f"train.logger must be 'jsonl' or 'tensorboard'; got {logger!r}")

    @property
    def path(self) -> Path:
        return self.jsonl.path

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        if self.writer is None:
            return
        step = int(record.get("step", 0))
        for key, value in record.items():
            if key == "step" or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                if math.isfinite(value):
                    self.writer.add_scalar(tag(key), value, step)
            elif key != "final":
                self.writer.add_text(key, str(value), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: val_loss -> val/loss, test_loss -> test/loss,
    loss -> train/loss."""
    for group in ("val", "test"):
        if key.startswith(f"{group}_"):
            return f"{group}/{key[len(group) + 1:]}"
    return f"train/{key}"


def _summary_writer(directory: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("train.logger 'tensorboard' needs the tensorboard package: "
                         "pip install 'routeformer[tensorboard]'") from None
    # purge_step: a resumed run hides the events an interrupted run wrote past its checkpoint.
    return SummaryWriter(log_dir=str(directory), purge_step=None if purge_step is None else purge_step + 1)
