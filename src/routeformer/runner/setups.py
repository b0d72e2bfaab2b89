"""What a budget says about one task: `TaskSetup` (the task's options, how every mechanism trains on
it, how it is evaluated and tested) and its curriculum `Stage`s.

A setup trains in stages: its `curriculum` (shorter, easier versions of the task: a shorter seq_len,
fewer MQAR pairs), then `schedule` on the task itself, each stage restarting AdamW's warm-up and
cosine decay. A setup without a curriculum trains in one stage (compare --quick, --full). It is
tested at its length T and, forward only, at each of `eval_multiples` times T. A setup with a
curriculum or evaluation multiples is *staged*: its runs' records name each evaluation's stage and
hold the tests per length (runner/jobs.py: `staged_record`), and the report gives it a section per length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from routeformer.train.schedule import Schedule

MIN_VALIDATION_SEQUENCES = 8  # a shorter stage is validated on as many tokens, in at least this many
MIN_TEST_SEQUENCES = 4  # a longer test (2T, 4T) reads as many tokens, in at least this many sequences
# the fields `as_dict` omits where they have their defaults (the staged ones, and `eval_every`), so
# that a setup which does not use them reads as it did before they existed
STAGED_FIELDS = ("curriculum", "eval_multiples", "task", "mechanism_options", "cost_batch", "eval_every")


@dataclass(frozen=True)
class Stage:
    """A stretch of training: `schedule` on the task built with `options` over the setup's (e.g. a
    shorter seq_len, fewer MQAR pairs; {}: the task itself)."""

    options: dict[str, Any]
    schedule: Schedule


@dataclass(frozen=True)
class TaskSetup:
    """One task of a budget (module docstring). `options`: what `build_task` gets at the length T the
    task is tested at; `evals` evaluations per stage on `validation_sequences` (at T; a shorter stage
    on as many tokens); `test_sequences` at T (at k·T as many tokens); `task`: the registered task
    when it differs from the setup's name in its budget (e.g. `mqar_512` builds `mqar`);
    `mechanism_options`: a mechanism's training recipe on this task, over compare's length budgets;
    `cost_batch`: sequences per inference call when a staged setup's costs are timed; `eval_every`:
    evaluate every this many steps of a stage (and at its end) in place of `evals` evenly spaced
    evaluations (0, the default: `evals`). ValueError naming `evals`, `eval_every` or
    `eval_multiples` for a bad value."""

    options: dict[str, Any]
    schedule: Schedule
    evals: int = 4
    validation_sequences: int = 256
    test_sequences: int = 1024
    curriculum: tuple[Stage, ...] = ()
    eval_multiples: tuple[int, ...] = ()
    task: str = ""
    mechanism_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    cost_batch: int = 4
    eval_every: int = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.eval_multiples if not isinstance(m, int) or m < 2]
        if bad:
            raise ValueError(f"eval_multiples must be integers >= 2 (T itself is always tested); got {bad}")
        if not isinstance(self.evals, int) or self.evals < 1:
            raise ValueError(f"evals must be a positive integer; got {self.evals!r}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError("eval_every must be an integer >= 0 (0: evals evenly spaced); "
                             f"got {self.eval_every!r}")

    def eval_every_in(self, steps: int) -> int:
        """Steps between a stage's evaluations for a stage of `steps` steps: `eval_every` when set,
        else `steps // evals` (at least 1)."""
        return self.eval_every or max(1, steps // self.evals)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage in order: the curriculum, then `schedule` on the task itself."""
        return (*self.curriculum, Stage({}, self.schedule))

    @property
    def total_steps(self) -> int:
        """The training steps of every stage together."""
        return sum(stage.schedule.steps for stage in self.stages)

    @property
    def staged(self) -> bool:
        """Whether runs of this setup go through stages or lengths beyond T (see the module docstring)."""
        return bool(self.curriculum or self.eval_multiples)

    @property
    def seq_len(self) -> int:
        """T: the length the task is built at (a setup whose length follows from other options has none)."""
        if "seq_len" not in self.options:
            raise ValueError(f"this setup states no seq_len (options {sorted(self.options)})")
        return int(self.options["seq_len"])

    @property
    def lengths(self) -> tuple[int, ...]:
        """T and every evaluation multiple of it."""
        return tuple(self.seq_len * multiple for multiple in (1, *self.eval_multiples))

    def task_name(self, key: str) -> str:
        """The registered task of the setup named `key` in its budget."""
        return self.task or key

    def validation_sequences_at(self, length: int, train_length: int) -> int:
        """Validation sequences of a stage at `length`: `validation_sequences` at T, else as many
        tokens (at least MIN_VALIDATION_SEQUENCES sequences)."""
        if length == train_length:
            return self.validation_sequences
        return max(MIN_VALIDATION_SEQUENCES, self.validation_sequences * train_length // length)

    def test_sequences_at(self, multiple: int) -> int:
        """Test sequences at `multiple`·T: `test_sequences` at T, else as many tokens (at least
        MIN_TEST_SEQUENCES sequences)."""
        if multiple == 1:
            return self.test_sequences
        return max(MIN_TEST_SEQUENCES, self.test_sequences // multiple)

    def as_dict(self) -> dict[str, Any]:
        """The setup as JSON-ready data; the staged fields only where they differ from their defaults,
        so a one-stage setup reads as it did before setups had stages (run directories compare it)."""
        data = asdict(self)
        for item in fields(self):
            if item.name not in STAGED_FIELDS:
                continue
            default = item.default_factory() if callable(item.default_factory) else item.default
            if getattr(self, item.name) == default:
                data.pop(item.name)
        return data
