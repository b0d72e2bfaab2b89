"""Train a causal model on a recall task, with or without meta-tokens: one run of the meta-tokens
reproduction (experiments/meta_tokens_recall.py) on the shared recall tasks.

A run trains a small causal model (ModelSpec's backbone with rotary positions) on one recall task
of `routeformer.tasks` in one of these variants, which differ one thing at a time:

- `plain`: `full` attention, sequences without `_PAUSE_` (the baseline);
- `pause`: `full` attention, `_PAUSE_` closing every segment (the tokens without meta-attention);
- `meta`: the `meta_tokens` layer in the paper's layout (meta-attention after the standard
  attention, own projections), `_PAUSE_` closing every segment;
- `meta_parallel`: the earlier form (shared Q/K/V, parallel to the standard attention).

Positions (`positions`): "keep" (every token at its place), "skip" (meta-tokens do not advance the
counter; tasks/meta_tokens.py), or "zero" (the paper's: rotary angle 0 at meta-tokens, in training
and evaluation). Every variant trained with the same seed sees the same sequences: batches are
drawn from the task with `_PAUSE_` and the `plain` variant reads them with the `_PAUSE_` columns
removed. (Drawing from the task without `_PAUSE_` would not do: the train/validation/test split is a
hash of the tokens, so the two tasks keep different subsets of the same draws.)

A run can start from a pre-trained body (`init`): a `full` model trained on the char-LM task, whose
blocks and final norm are loaded (the embeddings and the head are new: the vocabularies differ);
the meta-attention's own output projection then starts at zero, so the fine-tuned model starts as
the pre-trained function.

The record holds the validation history (1×), validation and test accuracy at the training length
(1×) and at twice as many segments (2×), the parameter count and the wall-clock.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.runner.setups import Stage
from routeformer.tasks import build_task
from routeformer.tasks.base import IGNORE_INDEX, Task
from routeformer.tasks.meta_tokens import meta_positions
from routeformer.tasks.recall_sequences import PAUSE
from routeformer.train.on_task import ModelSpec, parameter_count
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import TaskTrainConfig, train_task

VARIANTS = ("plain", "pause", "meta", "meta_parallel")
POSITION_SCHEMES = ("keep", "skip", "zero")
LENGTH_FACTORS = (1, 2)  # evaluation at the training length and at twice the segments
RECALL_SCHEDULE = Schedule(steps=600, batch_size=32, lr=3e-3, warmup_steps=60)  # a RecallRun's default


@dataclass(frozen=True)
class RecallRun:
    task: str
    task_options: dict[str, Any]
    variant: str = "meta"
    positions: str = "skip"
    seed: int = 0
    schedule: Schedule = RECALL_SCHEDULE
    evals: int = 4
    spec: ModelSpec = ModelSpec(positions="rotary")
    init: str | None = None  # path of a pre-trained body (state dict), or None: from scratch
    # stages trained before `schedule`, shortest first (compare's Stage: task option overrides, e.g.
    # {"segments": 4}, and the stage's Schedule); () = none
    curriculum: tuple[Stage, ...] = ()
    validation_sequences: int = 256
    test_sequences: int = 512

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}; got {self.variant!r}")
        if self.positions not in POSITION_SCHEMES:
            raise ValueError(f"positions must be one of {POSITION_SCHEMES}; got {self.positions!r}")
        for entry in self.curriculum:
            if not isinstance(entry, Stage):
                raise ValueError(f"curriculum entries are Stage(task option overrides, Schedule); "
                                 f"got {entry!r}")
        if self.spec.positions != "rotary":
            raise ValueError(f"spec.positions must be 'rotary' (2x lengths need no unseen learned "
                             f"positions); got {self.spec.positions!r}")

    @property
    def with_pause(self) -> bool:
        return self.variant != "plain"

    def build_task(self, factor: int = 1, meta: bool = True, overrides: dict[str, Any] | None = None) -> Task:
        """The task the sequences are drawn from (with `_PAUSE_`; see `read`), `factor` × the segments
        (of the task options with `overrides`: a curriculum stage's)."""
        options = dict(self.task_options, **(overrides or {}), meta=meta)
        options["segments"] = options.get("segments", 8) * factor
        return build_task(self.task, **options)

    def read(self, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """What this variant reads of a drawn batch: `plain` drops the `_PAUSE_` columns (they sit at
        the same places in every sequence: segments have a fixed length)."""
        if self.with_pause or inputs.shape[0] == 0:
            return inputs, labels
        keep = inputs[0] != PAUSE
        return inputs[:, keep], labels[:, keep]


def build_model(run: RecallRun) -> CausalLM:
    mechanism = "full" if run.variant in ("plain", "pause") else "meta_tokens"
    options = {"meta_tokens": {"meta_input": "parallel", "meta_projections": "shared"}} \
        if run.variant == "meta_parallel" else {}
    spec = run.spec
    config = ModelConfig(
        vocab_size=run.build_task().vocab_size, dim=spec.dim, depth=spec.depth, heads=spec.heads,
        mlp_ratio=spec.mlp_ratio, attention=mechanism, attention_options=options, positions="rotary",
        max_seq_len=run.build_task(max(LENGTH_FACTORS)).seq_len, tie_embeddings=False,
        meta_token_id=PAUSE if run.with_pause else None,
        zero_meta_positions_train=run.positions == "zero" and run.with_pause,
        zero_meta_positions_eval=run.positions == "zero" and run.with_pause)
    torch.manual_seed(run.seed)
    return CausalLM(config)


def load_body(model: CausalLM, path: str) -> None:
    """Load a pre-trained body (blocks and final norm; the vocabulary-sized parts stay new)."""
    state = torch.load(path, weights_only=True)
    body = {name: value for name, value in state.items()
            if not name.startswith(("backbone.token_embedding", "lm_head", "backbone.position_embedding"))}
    missing, unexpected = model.load_state_dict(body, strict=False)
    new = {name for name in missing
           if not name.startswith(("backbone.token_embedding", "lm_head")) and ".meta_" not in name}
    if new or unexpected:
        raise ValueError(f"pre-trained body {path!r} does not fit: missing {sorted(new)}, "
                         f"unexpected {sorted(unexpected)}")
    for block in model.backbone.blocks:
        meta_out = getattr(block.attention, "meta_out_proj", None)
        if meta_out is not None:
            torch.nn.init.zeros_(meta_out.weight)  # start as the pre-trained function


def positions_of(run: RecallRun, inputs: Tensor) -> Tensor:
    """The positions the model reads (zeroing is done by the backbone from the config)."""
    scheme = "skip" if run.positions == "skip" and run.with_pause else "keep"
    return meta_positions(inputs == PAUSE if run.with_pause else torch.zeros_like(inputs, dtype=torch.bool),
                          scheme)


@torch.no_grad()
def accuracy(model: CausalLM, run: RecallRun, task: Task, split: str, sequences: int) -> float:
    """Exact-match accuracy of the asked tokens on the task's fixed sample of `split`."""
    was_training = model.training
    model.eval()
    inputs, labels = run.read(*task.fixed_sample(split, sequences))
    correct = asked = 0
    for start in range(0, inputs.shape[0], 128):
        chunk, chunk_labels = inputs[start:start + 128], labels[start:start + 128]
        logits = model(chunk, chunk_labels, positions=positions_of(run, chunk), logits_at_labels=True).logits
        targets = chunk_labels[chunk_labels != IGNORE_INDEX]
        correct += int((logits.argmax(-1) == targets).sum())
        asked += targets.numel()
    model.train(was_training)
    return correct / max(asked, 1)


def train_recall(run: RecallRun, log=None) -> dict[str, Any]:
    """Train the run's model and return its JSON-ready record (module docstring)."""
    model = build_model(run)
    if run.init is not None:
        load_body(model, run.init)
    def forward(m, inputs, labels):
        return m(inputs, labels, positions=positions_of(run, inputs), logits_at_labels=True)

    began = time.perf_counter()
    stages = [*run.curriculum, Stage({}, run.schedule)]
    evals, train_seconds = [], 0.0
    for index, stage in enumerate(stages):
        task = run.build_task(overrides=stage.options)
        config = TaskTrainConfig(stage.schedule, eval_every=max(1, stage.schedule.steps // run.evals),
                                 seed=run.seed)

        def validate(m, task=task) -> dict[str, float]:
            return {"accuracy": accuracy(m, run, task, "validation", run.validation_sequences)}

        def make_batch(size: int, generator: torch.Generator, task=task) -> tuple[Tensor, Tensor]:
            return run.read(*task.batch(size, generator, "train"))

        history = train_task(model, make_batch, validate, config, forward=forward, log=log)
        tagged = [{**entry, "stage": index} for entry in history.evals] if run.curriculum else history.evals
        evals, train_seconds = evals + tagged, train_seconds + history.train_seconds
    record: dict[str, Any] = {"run": asdict(run), "parameters": parameter_count(model),
                              "validation_history": evals, "train_seconds": train_seconds}
    for factor in LENGTH_FACTORS:
        long_task = run.build_task(factor)
        sample = run.read(*long_task.batch(1, torch.Generator().manual_seed(0)))[0]
        record[f"seq_len_{factor}x"] = sample.shape[1]  # what this variant reads
        record[f"validation_{factor}x"] = accuracy(model, run, long_task, "validation",
                                                   run.validation_sequences)
        record[f"test_{factor}x"] = accuracy(model, run, long_task, "test", run.test_sequences)
    record["seconds"] = time.perf_counter() - began
    return record


def floors(run: RecallRun) -> dict[str, dict[str, float]]:
    """Chance and the measured shortcut floor of the run's task at each evaluated length."""
    out = {}
    for factor in LENGTH_FACTORS:
        task = run.build_task(factor, meta=False)  # the same distribution; rules read plain sequences
        out[f"{factor}x"] = {"chance": task.chance, "floor": task.floor(), **task.baselines(1024)}
    return out


def pretrain_body(path: Path, seed: int, steps: int, spec: ModelSpec, corpus: str = "pydoc",
                  seq_len: int = 128, lr: float = 3e-3, log=None) -> dict[str, Any]:
    """Pre-train a `full` causal model on the char-LM task (no meta-tokens) and save its weights."""
    task = build_task("lm", corpus=corpus, seq_len=seq_len)
    config = ModelConfig(vocab_size=task.vocab_size, dim=spec.dim, depth=spec.depth, heads=spec.heads,
                         mlp_ratio=spec.mlp_ratio, attention="full", positions="rotary",
                         max_seq_len=seq_len, tie_embeddings=False)
    torch.manual_seed(seed)
    model = CausalLM(config)

    @torch.no_grad()
    def bits(m) -> dict[str, float]:
        was_training = m.training
        m.eval()
        inputs, labels = task.fixed_sample("validation", 64)
        loss = float(m(inputs, labels).loss)
        m.train(was_training)
        return {"bits_per_char": loss / 0.6931471805599453}

    train = TaskTrainConfig(Schedule(steps=steps, batch_size=32, lr=lr, warmup_steps=max(1, steps // 10)),
                            eval_every=max(1, steps // 4), seed=seed)
    history = train_task(model, lambda size, gen: task.batch(size, gen, "train"), bits, train, log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return {"corpus": corpus, "seq_len": seq_len, "steps": steps, "seed": seed,
            "parameters": parameter_count(model), "validation_history": history.evals,
            "train_seconds": history.train_seconds}
