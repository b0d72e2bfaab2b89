"""`routeformer compare --long`: quality and cost of every mechanism at lengths where routing pays.

`compare --quick` trains at T = 32-128, where no routed layer saves anything; the layer benchmarks
measure savings at 4k-64k, where no model was trained. This budget joins them: each task is trained
at a long length T (associative recall and a Python-source character LM, both at T = 4096; the
earlier T = 512 / 1024 setups are kept as mqar_512 and lm), evaluated on
its test split at T and, forward only, at 2T and 4T (reported apart: the length-generalisation
claims of the meta-token and expanding-attention papers), and each mechanism's cost is measured at
the same lengths in the same report: training step time and inference time per sequence, both
alternating with `full` in the same rounds, executed attention FLOPs, and peak memory.

The machinery is compare's (runner/jobs.py): one job per (task, mechanism, seed), the same
batches per seed for every mechanism, the same backbone, finished runs kept on disk (a killed run
resumes after its last evaluation), chance and shortcut rules beside every number.

Training follows a curriculum (`Stage`s): most steps on a short, easy version of the task, where
attention learns what to look for cheaply, then the rest at T. The mechanism's length-dependent options
(budgets in keys: compare/budgets.py) are those of T throughout, so at the short stage a local window covers
the whole sequence. Each stage restarts AdamW's schedule (warm-up and cosine decay: its `Schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from routeformer.runner.jobs import TaskSetup
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule

LONG_MECHANISMS = ("full", "linear", "local", "topk", "mita", "meta", "meta_tokens", "expanding")
EVAL_MULTIPLES = (2, 4)  # evaluated (forward only) at these multiples of the training length


@dataclass(frozen=True)
class Stage:
    """A curriculum stage: training as `schedule` says on the task built with `options` overriding
    the training setup's (e.g. a shorter seq_len, fewer MQAR pairs; {}: the task itself)."""

    options: dict[str, Any]
    schedule: Schedule


@dataclass(frozen=True)
class LongSetup:
    """One task of the long budget: what `build_task` gets at the training length, its stages."""

    options: dict[str, Any]
    stages: tuple[Stage, ...]
    evals_per_stage: int = 2
    task: str = ""  # the registered task this setup builds; "" = the setup's name (its key in LONG.tasks)
    validation_sequences: int = 64
    test_tokens: int = 262_144  # tokens of the test split evaluated at every length
    cost_batch: int = 4  # sequences per inference call when timing
    # a mechanism's training recipe for this curriculum, over compare's length budgets (options_for)
    mechanism_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def options_for(self, mechanism: str) -> dict[str, Any]:
        """The layer options of `mechanism` here: compare's budget at T, then this setup's recipe."""
        from routeformer.compare.budgets import options_for

        return {**options_for(mechanism, self.seq_len), **self.mechanism_options.get(mechanism, {})}

    @property
    def seq_len(self) -> int:
        return int(self.options["seq_len"])

    def task_name(self, key: str) -> str:
        """The registered task of the setup named `key`."""
        return self.task or key

    def as_task_setup(self) -> TaskSetup:
        """The last stage as compare's TaskSetup, over the steps of all stages (task_options and the
        report read it)."""
        steps = sum(stage.schedule.steps for stage in self.stages)
        return TaskSetup(
            self.options,
            replace(self.stages[-1].schedule, steps=steps),
            validation_sequences=self.validation_sequences,
            test_sequences=self.test_tokens // self.seq_len,
        )



@dataclass(frozen=True)
class LongBudget:
    tasks: dict[str, LongSetup]
    spec: ModelSpec
    seeds: int = 3
    mechanisms: tuple[str, ...] = LONG_MECHANISMS
    repeats: int = 5


# Meta-Attention's recipe for the recall curriculum, chosen on validation (seeds 0-1; probes in
# docs/results/compare/long-1k/probes/README.md): the experts learn first — the first stage (600 training
# calls) runs the full expert alone (`warmup_mixture`; a uniform mixture stayed key-blind), then
# the KL term is annealed in at a small weight and hard routing (the paper's Phase 3 gate) anneals
# to η = 0.05, at evaluation too; the local expert reads 64 keys (a budget in keys, as topk's 64).
META_RECALL_RECIPE = {
    "window": 64, "warmup_steps": 600, "warmup_mixture": (1.0, 0.0, 0.0), "elbo_weight": 0.01,
    "kl_anneal_steps": 200, "train_eta": 0.05, "train_eta_start": 1.0, "eta_anneal_steps": 150,
    "eval_eta": 0.05,
}

# topk's recipe for the recall at T = 4096: a position-blind router (`routing_positions="none"`). The
# default recency router ranks keys by r_q·r_k − β·(i − j); a slope learnt on the short stages costs
# β·4000 at T = 4096, where the MQAR keys sit at the start of the context, and topk fell to 0.402 ±
# 0.067 (docs/results/compare/long-mqar-topk; its routing recall ~0.65 at T = 1024, ~0.17 at 4096). A
# dense distillation over every key all run did not help (0.371 / 0.413 on seeds 0 / 1); the blind
# router reached validation 1.0 at T = 1024 and 4096 on seeds 0 and 1
# (`docs/results/routers/topk_long_probe.py SEED --option "routing_positions='none'"`). Chosen on those
# validation curves; the T = 512 recall keeps the default (recency solved it on 5 of 5 seeds). Its cost:
# 3.45x full's step at T = 4096 (docs/results/compare/long-mqar-topk-blind): the blind first layer's
# routing keys take 15 distinct values, and the selection kernels slow down under the ties.
TOPK_LONG_RECALL_RECIPE = {"routing_positions": "none"}

# Chosen on validation (accuracy / bits per character of `full`), never on the test numbers the report
# shows; the probes are listed in docs/results/compare/long/README.md. MQAR: attention learns it through
# a phase transition that a small vocabulary and a long warm-up make reliable (compare --quick's setup,
# stage 1); once learnt at T=32 the lookup carries to longer T within a few dozen steps per length
# (T = 512 → 4096 drops to ~0.5 and recovers in ~100 steps), while a model started long, or with
# vocabulary ≥ 32 (the ≥ 32 pairs the issue asked for need ≥ 66), stayed at the key-blind level in
# the probes, and a lookup learnt on vocabulary 16 did not carry to new tokens. Seven pairs is what
# vocabulary 16 holds; the context sits at the start and queries uniformly over the rest, so all but
# ~1.5 % of them at T = 4096 are further from their key than a 64-key window reaches.
# Stage 1's learning rate is 1e-3 (3e-3 until 2026-11-28 14:30, the T = 4096 run in
# docs/results/compare/long/): at 3e-3 the phase transition failed on some seeds for every mechanism
# (full seed 7, meta's full expert seeds 1 and 3: training loss stuck at ln 4, also over 1200 steps
# or at 1e-2); at 1e-3 full passed on seeds 0-8 and meta's full expert on seeds 0-7 by step 300
# (docs/results/routers.md, `docs/results/routers/stage1_probe.py --lr`). The T = 512 stage likewise
# moved from 3e-3 to 1e-3 (15:20): at 3e-3 meta seeds 3 and 4 solved T = 128 and collapsed to chance
# in its first 100 steps; at 1e-3 both reach 1.0 (`docs/results/routers/meta_stage3_probe.py`).
_RECALL_WARMUP = (
    Stage({"seq_len": 32, "pairs": 4}, Schedule(steps=600, batch_size=64, lr=1e-3, warmup_steps=200)),
    Stage({"seq_len": 128}, Schedule(steps=150, batch_size=32, lr=3e-3, warmup_steps=30)),
)
LONG = LongBudget(
    tasks={
        # Recall at T = 4096 (issue 45): the T = 512 curriculum, then 1024 and 4096.
        "mqar": LongSetup(
            {"seq_len": 4096, "pairs": 7, "vocab_size": 16},
            stages=(
                *_RECALL_WARMUP,
                Stage({"seq_len": 512}, Schedule(steps=200, batch_size=16, lr=1e-3, warmup_steps=20)),
                Stage({"seq_len": 1024}, Schedule(steps=100, batch_size=8, lr=2e-3, warmup_steps=10)),
                Stage({}, Schedule(steps=150, batch_size=4, lr=1e-3, warmup_steps=10)),
            ),
            mechanism_options={"meta": META_RECALL_RECIPE, "topk": TOPK_LONG_RECALL_RECIPE},
        ),
        # The earlier long compare's recall at T = 512 (docs/results/compare/long-1k).
        "mqar_512": LongSetup(
            {"seq_len": 512, "pairs": 7, "vocab_size": 16},
            stages=(*_RECALL_WARMUP,
                    Stage({}, Schedule(steps=200, batch_size=16, lr=1e-3, warmup_steps=20))),
            mechanism_options={"meta": META_RECALL_RECIPE},
            task="mqar",
        ),
        # The earlier long compare's LM: Tiny Shakespeare (or the embedded corpus) at T = 1024.
        "lm": LongSetup(
            {"seq_len": 1024},
            stages=(
                Stage({"seq_len": 128}, Schedule(steps=250, batch_size=32, lr=3e-3, warmup_steps=25)),
                Stage({}, Schedule(steps=60, batch_size=8, lr=1e-3, warmup_steps=6)),
            ),
        ),
        # The long-range LM (issue 45): Python source at T = 4096, one file per window from its first
        # character. Stage 1 learns the characters on random T = 256 windows of the joined training
        # text (cheap); stage 2 reads whole file heads at T. Chosen on `full`'s validation curve
        # (docs/results/compare/long-code_lm/README.md); it needs ../shared/data/python-stdlib.
        "code_lm": LongSetup(
            {"seq_len": 4096},
            stages=(
                Stage({"seq_len": 256, "documents": "stream"},
                      Schedule(steps=1500, batch_size=32, lr=3e-3, warmup_steps=100)),
                Stage({}, Schedule(steps=300, batch_size=2, lr=1e-3, warmup_steps=20)),
            ),
            evals_per_stage=4,
        ),
    },
    spec=ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary"),
)
LONG_TASKS = tuple(LONG.tasks)
DEFAULT_LONG_TASKS = ("mqar", "code_lm")
OFFLINE_LONG_TASKS = ("mqar", "lm")  # where the Python-source corpus is not on disk


def default_long_tasks() -> tuple[str, ...]:
    """mqar and code_lm where the Python-source corpus is on disk (../shared/data/python-stdlib or
    ROUTEFORMER_DATA_DIR), else mqar and the T = 1024 lm: the long compare never downloads."""
    from routeformer.data.corpora import PYSTDLIB_FOLDER, find_data

    return DEFAULT_LONG_TASKS if find_data(f"{PYSTDLIB_FOLDER}/train.jsonl") else OFFLINE_LONG_TASKS


def check_long_selection(
    mechanisms: list[str] | None, tasks: list[str] | None
) -> tuple[list[str], list[str]]:
    """--mechanisms / --tasks for the long budget; None = its defaults. `full` always runs first
    (every ratio and Δ is against it)."""
    from routeformer.attention import list_attentions, with_baseline

    registered = list(list_attentions())
    chosen = list(mechanisms or LONG.mechanisms)
    unknown = [m for m in chosen if m not in registered]
    if unknown:
        raise ValueError(f"mechanisms: unknown {unknown}; registered: {registered}")
    chosen = with_baseline(dict.fromkeys(chosen))
    tasks = list(tasks or default_long_tasks())
    bad = [t for t in tasks if t not in LONG_TASKS]
    if bad:
        raise ValueError(f"tasks: --long has {list(LONG_TASKS)}; got {bad}")
    return chosen, tasks
