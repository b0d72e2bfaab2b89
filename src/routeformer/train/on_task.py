"""Train and evaluate one mechanism on one `routeformer.tasks` task: the unit every comparison
(compare, mqar-sweep, the paper experiments) is made of.

The model is a `TokenPredictor` (causal for causal tasks, bidirectional otherwise) whose layers
all run `mechanism`; batches come from `task.batch(..., split="train")` with a generator seeded
by `seed` only, so every mechanism trained with the same seed sees the same tokens. Validation
sequences are evaluated during training (for choosing setups); the record's `test` entry is
measured once, after training, on a fixed test sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from routeformer.models.config import ModelConfig
from routeformer.models.heads import TokenPredictor
from routeformer.tasks.base import IGNORE_INDEX, Task
from routeformer.tasks.positions import PositionBucketSums
from routeformer.train.task_loop import (
    TaskHistory,
    TaskTrainConfig,
    evaluations_to,
    is_main_process,
    layer_stat,
    train_config_dict,
    train_task,
    training_device,
    without_defaults,
)


@dataclass(frozen=True)
class ModelSpec:
    """The backbone every mechanism gets on a task (only the attention differs). `tie_embeddings`:
    the output head shares the token embedding's weight (ModelConfig.tie_embeddings; default False, a
    separate head); TypeError naming it unless a bool. `dropout`: ModelConfig.dropout, the dropout
    after each attention and MLP block and on the embeddings while training (default 0.0, none);
    ValueError naming it unless a number in [0, 1). `max_seq_len`: rows of a learned position table
    where it is to be longer than the task's seq_len (default 0: the task's seq_len, as the table
    has at least); ValueError naming it unless an integer >= 0. `zero_meta_positions_train` /
    `zero_meta_positions_eval`: ModelConfig's, no position at a meta-token in training / evaluation
    (default False; a task with meta-tokens only, ModelConfig refusing them elsewhere); TypeError
    naming them unless bools."""
    dim: int = 64
    depth: int = 2
    heads: int = 2
    mlp_ratio: float = 2.0
    positions: str = "learned"
    tie_embeddings: bool = False
    dropout: float = 0.0
    max_seq_len: int = 0
    zero_meta_positions_train: bool = False
    zero_meta_positions_eval: bool = False

    def __post_init__(self) -> None:
        for name in ("tie_embeddings", "zero_meta_positions_train", "zero_meta_positions_eval"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: must be a bool; got {getattr(self, name)!r}")
        rate = self.dropout
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"dropout: a number in [0, 1); got {rate!r}")
        object.__setattr__(self, "dropout", float(rate))
        rows = self.max_seq_len
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"max_seq_len: an integer >= 0 (0: the task's seq_len); got {rows!r}")


def spec_with(spec: ModelSpec, changes: dict[str, Any]) -> ModelSpec:
    """`spec` with the fields `changes` names set to their values (`{"dim": 32, "depth": 1}`).

    Raises ValueError naming `model.KEY` for a key that is no ModelSpec field, a `positions` outside
    models.config.POSITION_KINDS, `heads` that do not divide `dim`; otherwise as ModelSpec refuses a
    value."""
    from dataclasses import fields, replace

    from routeformer.models.config import POSITION_KINDS

    names = [field.name for field in fields(ModelSpec)]
    for key in changes:
        if key not in names:
            raise ValueError(f"model.{key}: not a backbone field; the fields are {names}")
    if changes.get("positions", POSITION_KINDS[0]) not in POSITION_KINDS:
        raise ValueError(f"model.positions: one of {list(POSITION_KINDS)}; got {changes['positions']!r}")
    changed = replace(spec, **changes)
    if changed.dim % changed.heads:
        raise ValueError(f"model.heads: must divide model.dim {changed.dim}; got {changed.heads}")
    return changed


# ModelSpec fields added after records were first written, with their defaults: `spec_dict` leaves a
# field out while it has its default, so the saved form of a spec that does not use it is unchanged
SPEC_DEFAULTS: dict[str, Any] = {"tie_embeddings": False, "dropout": 0.0, "max_seq_len": 0,
                                 "zero_meta_positions_train": False, "zero_meta_positions_eval": False}


def spec_dict(spec: ModelSpec) -> dict[str, Any]:
    """`spec` as records and run directories' config.json hold it: its fields, except those of
    SPEC_DEFAULTS that have their default value."""
    return without_defaults(asdict(spec), SPEC_DEFAULTS)


def mechanism_label(mechanism: str | list[str]) -> str:
    """A run's mechanism as one name for keys and directory names: the name itself, or the layers'
    names joined by "+" ("local+local+full")."""
    return mechanism if isinstance(mechanism, str) else "+".join(mechanism)


def layer_attention(mechanism: str | list[str], options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(ModelConfig.attention, ModelConfig.attention_options) of a run whose `mechanism` is one
    registered name, every layer running it with `options`, or a list of names, one per layer, with
    `options` then keyed by name ({"local": {"window": 64}}; a name without an entry runs its
    registered defaults). ValueError naming `options` when a per-layer run's options name a
    mechanism that is not among its layers."""
    if isinstance(mechanism, str):
        return mechanism, ({mechanism: options} if options else {})
    strays = sorted(set(options) - set(mechanism))
    if strays:
        raise ValueError(f"options: with a mechanism per layer ({list(mechanism)}) the options are keyed by "
                         f"the layers' mechanisms; got options for {strays}")
    return list(mechanism), {name: values for name, values in options.items() if values}


def build_task_model(task: Task, mechanism: str | list[str], options: dict[str, Any],
                     spec: ModelSpec) -> TokenPredictor:
    """A fresh `TokenPredictor` for `task` (its vocabulary, length, causality and meta-token) whose
    layers run `mechanism` with `options` (`layer_attention`: one name for every layer, or one per
    layer), on the backbone `spec` (positions for the longer of the task's seq_len and
    `spec.max_seq_len`). ValueError as `layer_attention` and ModelConfig raise (a list whose length is
    not `spec.depth`, a name that is not registered)."""
    attention, attention_options = layer_attention(mechanism, options)
    config = ModelConfig(vocab_size=task.vocab_size, dim=spec.dim, depth=spec.depth, heads=spec.heads,
                         mlp_ratio=spec.mlp_ratio, attention=attention, attention_options=attention_options,
                         positions=spec.positions, max_seq_len=max(task.seq_len, spec.max_seq_len),
                         causal=task.causal,
                         tie_embeddings=spec.tie_embeddings, dropout=spec.dropout,
                         meta_token_id=getattr(task, "meta_token_id", None),
                         zero_meta_positions_train=spec.zero_meta_positions_train,
                         zero_meta_positions_eval=spec.zero_meta_positions_eval)
    return TokenPredictor(config)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Routing diagnostics a record carries when the layers report them (mean over layers and batches):
# topk's recall of the dense attention mass, and Meta-Attention's hard-routed share of tokens, the
# share of tokens each expert computed, and its executed FLOPs against the full expert alone.
ROUTING_STATS = ("routing_recall", "hard_fraction", "rows_full", "rows_linear", "rows_local",
                 "flops_vs_full")


@torch.no_grad()
def evaluate_on_task(model: TokenPredictor, task: Task, split: str, sequences: int,
                     batch_size: int = 256, position_buckets: Sequence[int] | None = None) -> dict[str, Any]:
    """The task's metric on a fixed sample of `split` (accuracy at the asked positions, or bits per
    token for LM tasks), the mean loss in nats, and the attention FLOPs executed per token. The
    sample is drawn on the CPU and each batch of it moved to the model's device.

    For LM tasks (metric "bits_per_char") the record also holds `bits_per_char_by_position`
    ({"0-256": bits, ...}) and `tokens_by_position` (the count of predictions in each bucket),
    from the per-token losses: bucket "lo-hi" is the window slots lo <= t < hi (tasks/positions.py;
    `position_buckets` are the edges, default 0, 256, 1024, 2048, 4096, ... clipped to T). The
    count-weighted mean of the buckets is `bits_per_char`. With lm's documents="start" a slot is
    the position in the file, and for a task with `copy_predictable` (lm, code_lm) the record also
    holds `bits_per_char_copy_predictable` and `copy_predictable_fraction` ({"8": ..., "16": ...},
    per context length of the task's `copy_contexts`): the bits/char on the characters a copy from
    far back predicts, and their share of the asked characters (NaN bits where there are none)."""
    if position_buckets is not None and task.metric != "bits_per_char":
        raise ValueError(f"position_buckets applies to LM tasks (bits_per_char); task {task.name!r} "
                         f"reports {task.metric}")
    was_training = model.training
    model.eval()
    inputs, labels = task.fixed_sample(split, sequences)
    device = next(model.parameters()).device
    by_position = (PositionBucketSums(inputs.shape[1], position_buckets)
                   if task.metric == "bits_per_char" and inputs.shape[1] > 0 else None)
    correct = asked = 0
    nats = flops = 0.0
    routing: dict[str, list[float]] = {}
    copy_masks = {}
    if by_position is not None and hasattr(task, "copy_predictable"):
        copy_masks = {context: task.copy_predictable(split, sequences, context)
                      for context in getattr(task, "copy_contexts", ())}
        copy_masks = {context: mask for context, mask in copy_masks.items() if mask is not None}
    token_losses = []
    for start in range(0, inputs.shape[0], batch_size):
        chunk_labels = labels[start:start + batch_size]
        chunk_inputs, on_device = inputs[start:start + batch_size].to(device), chunk_labels.to(device)
        result = model(chunk_inputs, on_device, mask=task.mask(chunk_inputs), logits_at_labels=True)
        targets = on_device[on_device != IGNORE_INDEX]
        correct += int((result.logits.argmax(-1) == targets).sum())
        nats += float(torch.nn.functional.cross_entropy(result.logits.float(), targets, reduction="sum"))
        if by_position is not None:
            token_nats = torch.nn.functional.cross_entropy(result.logits.float(), targets,
                                                           reduction="none").cpu()
            by_position.add(token_nats, chunk_labels)
            if copy_masks:
                token_losses.append(token_nats.detach().double())
        asked += targets.numel()
        flops += sum(float(layer["flops"]) for layer in result.stats)
        for key in ROUTING_STATS:
            value = layer_stat(result.stats, key)
            if value is not None:
                routing.setdefault(key, []).append(value)
    model.train(was_training)
    record = {"loss": nats / asked, "accuracy": correct / asked,
              "attention_flops_per_token": flops / inputs.numel()}
    if task.metric != "accuracy":
        record[task.metric] = record["loss"] / math.log(2)
    for key, values in routing.items():
        record[key] = sum(values) / len(values)
    if by_position is not None:
        record["bits_per_char_by_position"] = by_position.bits()
        record["tokens_by_position"] = by_position.token_counts()
    if copy_masks:
        all_nats, asked_at = torch.cat(token_losses), labels != IGNORE_INDEX
        record["bits_per_char_copy_predictable"], record["copy_predictable_fraction"] = {}, {}
        for context, mask in copy_masks.items():
            chosen = all_nats[mask[asked_at]]
            record["bits_per_char_copy_predictable"][str(context)] = (
                float(chosen.mean()) / math.log(2) if chosen.numel() else math.nan)
            record["copy_predictable_fraction"][str(context)] = chosen.numel() / asked
    return record


def train_stages(
    model: TokenPredictor, stages: Iterable[tuple[Task, TaskTrainConfig, int]],
    log_for: Callable[[int, Task], Callable[[str], None] | None] = lambda index, task: None,
    on_eval: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[TaskHistory]:
    """Train `model` on each stage in turn: (task, config, validation sequences), the task's training
    batches for `config`'s schedule, evaluated every `config.eval_every` steps on that many of its
    validation sequences (an iterable: a stage's task may be built when the stage begins). Returns each
    stage's history; `log_for(index, task)` hears a stage's lines and `on_eval(index, record)` (None:
    nothing) each evaluation of the stage as it is made (`task_loop.evaluations_to`: the record its
    history gains, `step` counted within the stage; not those a resumed stage reads back)."""
    histories = []
    for index, (task, config, sequences) in enumerate(stages):
        def forward(model, inputs, labels, task=task, **extra):
            return model(inputs, labels, mask=task.mask(inputs), logits_at_labels=True, **extra)

        listening = (nullcontext() if on_eval is None
                     else evaluations_to(lambda record, index=index: on_eval(index, record)))
        with listening:
            histories.append(train_task(
                model, lambda batch_size, generator, task=task: task.training_batch(batch_size, generator),
                lambda m, task=task, sequences=sequences: evaluate_on_task(m, task, "validation", sequences),
                config, forward=forward, log=log_for(index, task)))
    return histories


def train_on_task(
    task: Task, mechanism: str, options: dict[str, Any], *, seed: int, train: TaskTrainConfig,
    spec: ModelSpec = ModelSpec(), validation_sequences: int = 256, test_sequences: int = 1024,
    log: Callable[[str], None] | None = None,
    after_training: Callable[[TokenPredictor], dict[str, Any]] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train a fresh model (initialised from `seed`, built on `task_loop.training_device()`: the
    innermost `training_on` block's device, else the CPU) and return a JSON-ready record: the
    validation history, `test` (the task's metric on the test sample), parameter count, wall-clock,
    `model` (`spec_dict(spec)`) and `train` (`train_config_dict(train)`: the schedule, seed,
    `precision` and, where not the default, AdamW's `betas` it trained with). Inside
    `task_loop.distributed_training` with several processes, the processes other than 0 train
    alongside process 0 and return {} (neither testing nor calling `after_training`). `on_eval(record)`
    (None: nothing) hears each validation evaluation as it is made (`train_stages`' on_eval); the
    record is the same with or without it."""
    if train.seed != seed:
        raise ValueError(f"train.seed ({train.seed}) must equal seed ({seed})")
    torch.manual_seed(seed)
    model = build_task_model(task, mechanism, options, spec).to(training_device())
    history, = train_stages(model, [(task, train, validation_sequences)], lambda index, stage_task: log,
                            on_eval=None if on_eval is None else lambda index, record: on_eval(record))
    if not is_main_process():
        return {}
    test = evaluate_on_task(model, task, "test", test_sequences)
    record = {"task": task.describe(), "mechanism": mechanism, "options": options, "seed": seed,
              "model": spec_dict(spec), "train": train_config_dict(train),
              "parameters": parameter_count(model),
              "validation": history.evals, "test": test, "quality": test[task.metric],
              "attention_flops_per_token": test["attention_flops_per_token"],
              "train_seconds": history.train_seconds}
    if after_training is not None:
        record.update(after_training(model))
    return record
