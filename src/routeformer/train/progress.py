"""Peak memory, and the JSONL metrics log of a run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


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
    """Append-only JSONL; on resume, records past the checkpoint's step are dropped first (the file
    is rewritten atomically: an interrupt there leaves the old file or the new one, never less)."""

    def __init__(self, path: str | Path, resume_step: int | None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            write_text_atomic(self.path, "")
        elif self.path.exists():
            kept = [line for line, record in _parsed_lines(self.path) if record.get("step", 0) <= resume_step]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none when it does not exist); a line cut short by a killed
    process is left out."""
    path = Path(path)
    return [record for _, record in _parsed_lines(path)] if path.is_file() else []


def _parsed_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    parsed = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            parsed.append((line, record))
    return parsed


def write_text_atomic(path: str | Path, text: str) -> None:
    """path := text, through a temporary file and a rename: readers (and an interrupted writer)
    see the old content or the new, never a part."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
