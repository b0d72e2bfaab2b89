"""What a run directory holds before a run starts in it: whether the path can be one
(`check_out_dir`), what an earlier run left there that starting over would replace (`earlier_run`),
and how a changed config is told (`flatten`, `describe`). runner/run_dir.py applies them.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from routeformer.train.progress import read_records


def check_out_dir(out_dir: Path) -> None:
    """ValueError unless `out_dir` is a directory or can become one."""
    for parent in (out_dir, *out_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"out_dir {str(out_dir)!r} cannot be a run directory: {str(parent)!r} is a file")



def earlier_run(out_dir: Path, stem: str = "checkpoint") -> str:
    """What an earlier run left in `out_dir` that a fresh start would replace ('' when nothing): the
    lines of its metrics.jsonl, and checkpoints `<stem>*.corrupt` a resume moved aside (a task run
    directory's: `record.train`)."""
    found = []
    records = [record for record in read_records(out_dir / "metrics.jsonl") if "step" in record]
    if records:
        found.append(f"metrics.jsonl of an earlier run (up to step {max(r['step'] for r in records)})")
    corrupt = sorted(path.name for path in out_dir.glob(f"{glob.escape(stem)}*.corrupt"))
    if corrupt:
        found.append(f"corrupt checkpoint(s) {', '.join(corrupt)}")
    return " and ".join(found)



def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"dim": 32}} -> {"model.dim": 32} (nested mappings all the way down)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    """{key: (before, now)} as one line: `key 1 -> 2, other 'a' -> 'b'`."""
    return ", ".join(f"{key} {before!r} -> {after!r}" for key, (before, after) in changes.items())
