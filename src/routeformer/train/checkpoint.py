"""Checkpoints that resume exactly, cannot rot and never run code (model, optimizer, step, RNGs, ...).

A checkpoint file is one header line, `ROUTEFORMER-CHECKPOINT 2 sha256=<hex of the payload>`, then
the payload: a safetensors file holding every tensor, whose header metadata holds the rest of the
state as JSON (train/checkpoint_format.py). Loading parses JSON and tensor bytes only; nothing is
unpickled, so a checkpoint from someone else cannot execute code. The checksum is verified first,
so a file with overwritten or missing bytes is reported as corrupt (`CheckpointError`, one line
naming the file) instead of loading garbage weights. Files are written atomically (temporary file,
fsync, rename): a run killed mid-write keeps its previous checkpoint.

Files written by older versions (`ROUTEFORMER-CHECKPOINT 1`, or a bare `torch.save` zip) hold a
pickle; they are read with `torch.load(weights_only=True)`, PyTorch's restricted unpickler that
builds only tensors and plain containers. One that needs anything else gets a one-line
CheckpointError instead of being unpickled.

Checkpoints rotate (`save_rotating`): the newest is `<stem>.pt`, the ones before it `<stem>.1.pt`,
`<stem>.2.pt`, ... (the last `keep`); `latest_checkpoint` returns the newest intact one, reporting
(and moving aside, as `<name>.corrupt`) any corrupt file it passes. A run directory (`routeformer
train`) keeps its trained model as `checkpoint.pt` (`save_task_model`: the weights, the model
config, the task's name and options, the run's config and, for text tasks, the tokeniser) beside
its training checkpoints (`record.train0.pt`, ...: train/task_loop.py). An LM run directory of the
earlier layout holds rotating training states as `checkpoint.pt`, `checkpoint.1.pt`, ... with the
run's `RunConfig` and tokeniser; the readers below still read it.

The public readers, for code outside training (an exporter, an evaluation script, a conversion):
`load_checkpoint(path) -> dict` (the state), `load_run_model(path) -> RunModel` (model, task,
config, tokeniser, file, step: every run) and `load_trained_model(path) -> (model, vocab, config)`
(an LM run of the earlier layout); all take a run directory or a checkpoint file. `choose_checkpoint(path)`
also says which file (and so which step) a run directory gave, and whether a newer one was
unreadable; `checkpoint_for_use(path)` is the rule eval, sample, export-hf and `load_run_model`
share: a directory's newest checkpoint, refused (naming the newest intact one and its step) when
it is unreadable.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from routeformer.train.checkpoint_format import decode as decode_payload
from routeformer.train.checkpoint_format import encode as encode_payload

CHECKPOINT_NAME = "checkpoint.pt"
RESUME_ADVICE = "start over with --fresh"  # what `routeformer train` says when no checkpoint is intact
READ_ADVICE = ("nothing here can be read: train the run again (its `routeformer train` command with --fresh "
               "starts it over)")  # what eval, sample and export-hf say instead
TASK_RUN_KEEP = 2  # checkpoints a task run directory keeps (its final model, and the one before a re-save)
_MAGIC = b"ROUTEFORMER-CHECKPOINT 2 sha256="
_MAGIC_PICKLE = b"ROUTEFORMER-CHECKPOINT 1 sha256="  # version 1: a torch.save payload
_LEGACY_ZIP = b"PK\x03\x04"  # what torch.save wrote before checksums


class CheckpointError(Exception):
    """A checkpoint is missing, corrupt or truncated; the message is one line naming the file."""


class UnsafeCheckpointError(CheckpointError):
    """An intact checkpoint of an older version whose pickle needs more than tensors and plain values."""


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically with its checksum. Refuses non-finite model weights
    (`TrainingDiverged`): a checkpoint is a state worth resuming from."""
    from routeformer.train.guard import check_finite_weights

    if "model" in state:
        check_finite_weights(state["model"], where=f"checkpoint {str(path)!r}")
    payload = encode_payload(state)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        handle.write(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _sync_directory(path.parent)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state in checkpoint file `path` (a run directory: its newest intact checkpoint).

    Raises CheckpointError when the file is missing, corrupt or truncated."""
    path = Path(path)
    if path.is_dir():  # reading leaves the directory as it is: nothing moved aside
        return latest_checkpoint(path, quarantine=False)[1]
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    data = path.read_bytes()
    for magic in (_MAGIC, _MAGIC_PICKLE):
        if data.startswith(magic):
            header, _, payload = data.partition(b"\n")
            expected = header[len(magic):].decode("ascii", "replace")
            if hashlib.sha256(payload).hexdigest() != expected:
                raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or truncated (checksum mismatch, "
                                      f"{len(data):,} bytes)")
            if magic == _MAGIC:
                try:
                    return decode_payload(payload)
                except Exception as error:  # checksum intact: written by something else
                    raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {error}") from None
            return _load_pickled(path, payload)
    if data.startswith(_LEGACY_ZIP):
        return _load_pickled(path, data)
    raise CheckpointError(f"checkpoint {str(path)!r} is not a routeformer checkpoint (unknown header)")


def _load_pickled(path: Path, payload: bytes) -> dict[str, Any]:
    """A checkpoint of an older version, through PyTorch's restricted (weights_only) unpickler."""
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only load failed" in str(error).lower():
            raise UnsafeCheckpointError(
                f"checkpoint {str(path)!r} was written by an older routeformer and holds objects other than "
                "tensors and plain values, so it is not unpickled (that could run code); retrain, or, only "
                "if you trust the file, torch.load it yourself and re-save its state with "
                "routeformer.train.checkpoint.save_checkpoint") from None
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read (UnpicklingError)") from None
    except Exception as error:  # (a legacy file has no checksum: any unpickling failure is corruption)
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({type(error).__name__})") from None


def checkpoint_files(directory: str | Path, stem: str = "checkpoint") -> list[Path]:
    """A run directory's checkpoints named `stem`, newest first: `<stem>.pt`, `<stem>.1.pt`, ...
    (default: checkpoint.pt, checkpoint.1.pt, ...)."""
    directory = Path(directory)
    numbered = []
    for path in directory.glob(f"{glob.escape(stem)}.*.pt"):
        index = path.name[len(stem) + 1:-len(".pt")]
        if index.isdigit():
            numbered.append((int(index), path))
    newest = [directory / f"{stem}.pt"] if (directory / f"{stem}.pt").is_file() else []
    return newest + [path for _, path in sorted(numbered)]


def latest_checkpoint(directory: str | Path, *, report: Callable[[str], None] | None = None,
                      quarantine: bool = True, advice: str = RESUME_ADVICE) -> tuple[Path, dict[str, Any]]:
    """(path, state) of the newest intact checkpoint in a run directory.

    Each corrupt file passed on the way is reported (`report`, default: a line on stderr) and, with
    `quarantine`, renamed to `<name>.corrupt` so that later runs neither retry nor count it.
    Raises CheckpointError when the directory holds no intact checkpoint; when every one is corrupt,
    its message ends with `advice` (what to do: a training run starts over with --fresh, a reader
    says so in its own words)."""
    report = report or _print_warning
    directory = Path(directory)
    candidates = checkpoint_files(directory)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {str(directory)!r}")
    for path in candidates:
        try:
            return path, load_checkpoint(path)
        except FileNotFoundError:  # another process moved it aside meanwhile
            continue
        except UnsafeCheckpointError:
            raise  # intact, only refused: never moved aside as corrupt
        except CheckpointError as error:
            moved = ""
            if quarantine:
                os.replace(path, path.with_name(path.name + ".corrupt"))
                moved = f"; moved aside to {path.name}.corrupt"
            report(f"{error}{moved}")
    raise CheckpointError(f"no intact checkpoint in {str(directory)!r} (all {len(candidates)} corrupt); "
                          f"{advice}")


def save_rotating(directory: str | Path, state: dict[str, Any], *, keep: int,
                  stem: str = "checkpoint") -> Path:
    """Write `state` as the directory's newest checkpoint `<stem>.pt`, keeping the `keep` newest of
    that name in all (`checkpoint_files`); returns its path.

    The older files shift one name down (checkpoint.pt -> checkpoint.1.pt -> ...), each by an atomic
    rename, oldest first; a crash part-way leaves a gap in the names, never a damaged file. Raises
    ValueError unless `keep` is at least 1."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1 (the checkpoints kept); got {keep!r}")
    directory = Path(directory)
    temporary = directory / f"{stem}.new.tmp"
    save_checkpoint(temporary, state)  # written in full before anything older is renamed or deleted
    existing = checkpoint_files(directory, stem)
    kept, dropped = existing[:keep - 1], existing[keep - 1:]
    for path in dropped:
        path.unlink()
    for index in range(len(kept), 0, -1):  # from the back: no rename overwrites a kept file
        target = directory / f"{stem}.{index}.pt"
        if kept[index - 1] != target:
            os.replace(kept[index - 1], target)
    newest = directory / f"{stem}.pt"
    os.replace(temporary, newest)
    _sync_directory(directory)
    return newest


def remove_checkpoints(directory: str | Path) -> int:
    """Delete a run directory's checkpoints (a fresh start); returns how many there were."""
    files = checkpoint_files(directory)
    for path in files:
        path.unlink()
    return len(files)


def choose_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any], str | None]:
    """(file, state, what is newer but unreadable) for a run directory or a checkpoint file.

    For a directory, the file is its newest intact checkpoint; the third item is None when that is
    the run's newest checkpoint, else a line naming the newer ones that are corrupt (including those
    an earlier resume moved aside as `*.corrupt`). Nothing is moved; corrupt files are printed (stderr)
only when none is intact (CheckpointError)."""
    path = Path(path)
    if not path.is_dir():
        return path, load_checkpoint(path), None
    unreadable: list[str] = []
    try:
        chosen, state = latest_checkpoint(path, report=unreadable.append, quarantine=False,
                                          advice=READ_ADVICE)
    except CheckpointError:
        for message in unreadable:
            _print_warning(message)
        raise
    written = chosen.stat().st_mtime
    moved = sorted(path.glob("checkpoint*.corrupt"))
    unreadable += [f"{file.name} (moved aside as corrupt)" for file in moved
                   if file.stat().st_mtime > written]
    return chosen, state, "; ".join(unreadable) or None


def checkpoint_for_use(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(file, state) that eval, sample, export-hf and `load_run_model` read from a run directory or
    a checkpoint file: the directory's newest checkpoint, when it is intact.

    Raises CheckpointError when there is none, or when the newest is unreadable (corrupt, truncated,
    moved aside): the message names the newest intact file and its step, an older state, which is
    used only when that file is named explicitly."""
    chosen, state, unreadable = choose_checkpoint(path)
    if unreadable:
        raise CheckpointError(
            f"the newest checkpoint of {str(path)!r} is unreadable ({unreadable}); its newest intact one is "
            f"{str(chosen)!r} (step {state.get('step')}), an older state: name that file to use it")
    return chosen, state


def load_trained_model(path: str | Path):
    """(CausalLM in eval mode, tokeniser, RunConfig) from an LM run directory of the earlier layout
    (config.yaml beside checkpoint.pt) or one of its checkpoint files (`load_run_model` reads every
    run). The tokeniser is the run's own (CharVocab or BPETokenizer, data/tokenizers.py),
    rebuilt from the checkpoint: `tokeniser.encode(text)` gives the model's input ids."""
    return trained_model(load_checkpoint(path))


def trained_model(state: dict[str, Any]):
    """(CausalLM in eval mode, tokeniser, RunConfig) from a checkpoint's state."""
    from routeformer.data.tokenizers import tokenizer_from_dict
    from routeformer.models.heads import CausalLM
    from routeformer.train.config import RunConfig

    config = RunConfig.from_dict(state["config"])
    model = CausalLM(config.model)
    model.load_state_dict(state["model"])
    return model.eval(), tokenizer_from_dict(state["vocab"]), config


def save_task_model(directory: str | Path, model: Any, *, step: int, task: str, task_options: dict[str, Any],
                    run: dict[str, Any], vocab: dict[str, Any] | None = None,
                    keep: int = TASK_RUN_KEEP) -> Path:
    """Write a task run's trained `model` (a TokenPredictor or CausalLM) as the newest checkpoint of
    run directory `directory` (`save_rotating`, keeping `keep`); returns its path.

    The state holds what rebuilds the model without the code that trained it: `step` (the training
    steps done), `model` (the state dict), `model_config` (`ModelConfig.to_dict()`), `task`
    ({"name": the registered task, "options": what `build_task` gets}), `run` (the run's config:
    mechanism, seed, schedule, backbone) and, for a task whose tokens are text (lm, code_lm),
    `vocab` (the tokeniser's `to_dict()`). Saving reads the model and draws no random numbers."""
    state: dict[str, Any] = {"step": step, "model": model.state_dict(),
                             "model_config": model.config.to_dict(),
                             "task": {"name": task, "options": task_options}, "run": run}
    if vocab is not None:
        state["vocab"] = vocab
    return save_rotating(directory, state, keep=keep)


def is_task_model(state: dict[str, Any]) -> bool:
    """Whether a checkpoint's state is a task run's model (`save_task_model`) rather than the
    training state of an LM run of the earlier layout."""
    return "task" in state and "model_config" in state


def task_model(state: dict[str, Any]):
    """(model in eval mode, tokeniser or None) from a task run's checkpoint state: a CausalLM for a
    causal task (it can generate), else a bidirectional TokenPredictor; the tokeniser of a text task
    (None for a task of abstract tokens such as mqar)."""
    from routeformer.data.tokenizers import tokenizer_from_dict
    from routeformer.models.config import ModelConfig
    from routeformer.models.heads import CausalLM, TokenPredictor

    config = ModelConfig.from_dict(state["model_config"])
    model = CausalLM(config) if config.causal else TokenPredictor(config)
    model.load_state_dict(state["model"])
    vocab = tokenizer_from_dict(state["vocab"]) if state.get("vocab") is not None else None
    return model.eval(), vocab


@dataclass(frozen=True)
class RunModel:
    """A trained run's model with what it was trained as (`load_run_model`).

    `model`: in eval mode; a CausalLM for causal tasks and LM runs, a TokenPredictor otherwise.
    `task`: the task rebuilt from its name and options (None for an LM run directory of the earlier
    layout, whose text is `config["data"]`, and with `build_task=False`). `config`: the run's config
    as data (a task run's job: task, mechanism and its options, seed, setup, backbone; an
    earlier-layout LM run's `RunConfig.to_dict()`). `tokenizer`: the
    run's tokeniser (None for a task of abstract tokens). `checkpoint`, `step`: the file read and
    the training steps it holds."""

    model: Any
    task: Any
    config: dict[str, Any]
    tokenizer: Any
    checkpoint: Path
    step: int


def load_run_model(path: str | Path, *, build_task: bool = True) -> RunModel:
    """The trained model of a run directory or checkpoint file (a `routeformer train` run, or an LM
    run directory of the earlier layout), read by the rule eval and export-hf apply
    (`checkpoint_for_use`: the newest checkpoint, when intact).

    `build_task=False` leaves `task` None (building it may load a corpus). Raises CheckpointError
    when no usable checkpoint is found; ValueError as `task_of_run` does (the text or tokenizer
    changed since the run was trained), or the task's own when it cannot be rebuilt here (a corpus
    that is not on this machine)."""
    file, state = checkpoint_for_use(path)
    if is_task_model(state):
        model, vocab = task_model(state)
        task = task_of_run(state, file) if build_task else None
        return RunModel(model, task, state["run"], vocab, file, state["step"])
    model, vocab, config = trained_model(state)
    return RunModel(model, None, config.to_dict(), vocab, file, state["step"])


def task_of_run(state: dict[str, Any], file: str | Path) -> Any:
    """The task a task model's checkpoint `state` (read from `file`) was trained on, built again from
    its name and options. Raises ValueError when the task's tokeniser is not the one the run saved
    (the text or the tokenizer changed since the run was trained), or as the task's build raises."""
    from routeformer.tasks import build_task

    task = build_task(state["task"]["name"], **state["task"]["options"])
    saved = state.get("vocab")
    if saved is not None and getattr(task, "vocab", None) is not None and task.vocab.to_dict() != saved:
        raise ValueError(f"{str(file)!r}: the run's tokeniser is not its task's now ({task.describe()}): the "
                         "text or the tokenizer changed since the run was trained")
    return task


def _print_warning(message: str) -> None:
    print(f"routeformer: warning: {message}", file=sys.stderr, flush=True)


def _sync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
