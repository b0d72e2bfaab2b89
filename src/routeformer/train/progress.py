"""A dependency-free progress line with throughput, and the JSONL metrics log."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch


class Progress:
    """Prints `step 120/1200 [##----] loss 1.83 | 41.2k tok/s | eta 2m05s` to stderr."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None) -> None:
        self.total, self.start_step = total, start
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.tokens = 0
        self.interactive = self.stream.isatty()

    def tokens_per_second(self, tokens: int) -> float:
        """Count `tokens` more processed; return the rate since this process's run began."""
        self.tokens += tokens
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def show(self, step: int, values: dict[str, float]) -> None:
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / max(elapsed, 1e-9)
        eta = elapsed / max(step - self.start_step, 1) * (self.total - step)
        filled = int(20 * step / self.total)
        shown = " ".join(f"{key} {value:.4g}" for key, value in values.items())
        line = (f"step {step}/{self.total} [{'#' * filled}{'-' * (20 - filled)}] {shown} | "
                f"{rate / 1000:.1f}k tok/s | eta {int(eta // 60)}m{int(eta % 60):02d}s")
        self.stream.write(("\r" + line) if self.interactive else line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        self.stream.write(("\n" if self.interactive else "") + text + "\n")
        self.stream.flush()


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory in MiB: on CUDA, allocated tensor memory since the last call (then reset); on
    the CPU, the process's peak resident set size (which never goes down)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return round(peak / 2**20, 1)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB


class MetricsLog:
    """Append-only JSONL; on resume, records past the checkpoint's step are dropped first."""

    def __init__(self, path: str | Path, resume_step: int | None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
