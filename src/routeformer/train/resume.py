"""Starting a run in its directory: resume from the newest intact checkpoint, or start over.

Resuming with a changed config is allowed where it changes the training schedule (more steps, a
new learning rate, logging and checkpoint intervals, the precision, ...): the differences are
printed and appended to metrics.jsonl as a `config_changes` record. A change to the model, the
data it was trained on, or the seed would make the resumed run a different run; it is refused
with one line naming each change (use `--fresh` or another out_dir). `config.yaml` always holds
the config the run continues with; the one it replaces is kept beside it as
`config.before-step<N>.yaml` (N: the step the run continues from, 0 for a fresh start).

Nothing a rerun finds is lost: a directory that holds an earlier run's metrics or checkpoints but
no intact checkpoint refuses to start without `--fresh` (CheckpointError, one line), and a run
that already finished is not finished again (`recorded_final`: its final evaluation is read back
from metrics.jsonl, nothing is written).
"""

from __future__ import annotations

import glob
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from routeformer.train.checkpoint import (
    CheckpointError,
    checkpoint_files,
    latest_checkpoint,
    remove_checkpoints,
)
from routeformer.train.config import RunConfig
from routeformer.train.progress import read_records, write_text_atomic

# Changes a resumed run may take: everything in `train` but the seed, plus these.
_ACCEPTED_OUTSIDE_TRAIN = ("model.dropout", "data.seq_len")
_REFUSED_IN_TRAIN = ("train.seed",)


def check_out_dir(out_dir: Path) -> None:
    """ValueError unless `out_dir` is a directory or can become one."""
    for parent in (out_dir, *out_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"out_dir {str(out_dir)!r} cannot be a run directory: {str(parent)!r} is a file")


def find_resume_state(out_dir: Path, *, resume: bool, is_main: bool,
                      report: Callable[[str], None]) -> dict[str, Any] | None:
    """The checkpoint state to resume from (None: start at step 0).

    resume=False (`--fresh`) deletes the directory's checkpoints first (rank 0 only). Corrupt
    checkpoints are reported and skipped; CheckpointError when none is intact."""
    if not resume:
        if is_main and checkpoint_files(out_dir):
            removed = remove_checkpoints(out_dir)
            report(f"fresh start: removed {removed} checkpoint(s) of the earlier run in {str(out_dir)!r}")
        return None
    if not checkpoint_files(out_dir):
        left = earlier_run(out_dir)
        if left:
            raise CheckpointError(
                f"{str(out_dir)!r} holds {left} but no intact checkpoint to resume from; not starting over "
                "in it: use --fresh to start over (its metrics.jsonl is then replaced), or another out_dir")
        return None
    path, state = latest_checkpoint(out_dir, report=lambda message: report(f"warning: {message}"),
                                    quarantine=is_main)
    if path.name != "checkpoint.pt":
        report(f"resuming from {str(path)!r} (step {state['step']}), the newest intact checkpoint")
    return state


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


def recorded_final(out_dir: Path, step: int) -> dict[str, Any] | None:
    """The final evaluation metrics.jsonl records at `step` ({"loss": ..., "bpc": ...}), or None."""
    for record in reversed(read_records(out_dir / "metrics.jsonl")):
        if record.get("final") and record.get("step") == step:
            return {key[len("val_"):]: value for key, value in record.items() if key.startswith("val_")}
    return None


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


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, current value)} for every setting that differs (out_dir aside:
    a run directory may be moved)."""
    before = flatten(RunConfig.from_dict(saved).to_dict())
    after = flatten(current)
    keys = sorted((set(before) | set(after)) - {"out_dir"})
    return {key: (before.get(key), after.get(key)) for key in keys if before.get(key) != after.get(key)}


def is_accepted(key: str) -> bool:
    """Whether a resumed run may take a change of `key` (see the module docstring)."""
    if key.startswith("train."):
        return key not in _REFUSED_IN_TRAIN
    return key in _ACCEPTED_OUTSIDE_TRAIN


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} {before!r} -> {after!r}" for key, (before, after) in changes.items())


def check_changes(changes: dict[str, tuple[Any, Any]], out_dir: Path, step: int) -> None:
    """ValueError naming every change a resumed run cannot take."""
    refused = {key: change for key, change in changes.items() if not is_accepted(key)}
    if refused:
        raise ValueError(
            f"cannot resume {str(out_dir)!r} (step {step}) with a different model, data or seed: "
            f"{describe(refused)}; use --fresh to start over, or another out_dir")


def write_config(out_dir: Path, config: RunConfig, *, step: int) -> Path | None:
    """config.yaml := `config`. An earlier, different config.yaml is never lost: it is kept as
    config.before-step<step>.yaml, whose path is returned (None when nothing was kept)."""
    path = out_dir / "config.yaml"
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    kept = None
    if path.is_file() and path.read_text() != text:  # copied, then replaced: config.yaml never missing
        kept = out_dir / f"config.before-step{step}.yaml"
        write_text_atomic(kept, path.read_text())
    write_text_atomic(path, text)
    return kept
