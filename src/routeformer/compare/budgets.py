"""The budgets of `routeformer compare` (QUICK, FULL, LONG) and what each mechanism gets on a task.

Length-dependent budgets (the only options that differ from a mechanism's defaults), in keys a
query reads (`TOPK_KEYS` = 64) once T is long enough: local windows T/4 up to 64 keys (fixed from
T = 256 on), top-k T/8 keys up to 64 (fixed from T = 512 on), MiTA T/8 landmarks of T/8 keys
(causal: blocks of T/8) below T = 512 and from there blocks and experts of 64 keys with every
completed block's landmark (T/64), Meta-Attention's local expert as local's window: each layer
class says its own (`budget_options(seq_len, keys)`), under compare's key budget.
A mechanism that needs injected meta-tokens (`needs_meta_tokens`: `meta_tokens`) runs on the LM
only, whose windows then carry `_PAUSE_` at density 0.1 (so it reads 10% fewer characters per
window: stated in the report).

LONG (`compare --long`): quality and cost of every mechanism at lengths where routing pays.
`compare --quick` trains at T = 32-128, where no routed layer saves anything; the layer benchmarks
measure savings at 4k-64k, where no model was trained. This budget joins them: each task is trained
at a long length T (associative recall and a Python-source character LM, both at T = 4096; the
earlier T = 512 / 1024 setups are kept as mqar_512 and lm), evaluated on its test split at T and,
forward only, at 2T and 4T (reported apart: the length-generalisation claims of the meta-token and
expanding-attention papers), and each mechanism's cost is measured at the same lengths in the same
report (compare/costs.py). Training follows a curriculum (runner/setups.py's stages): most steps on
a short, easy version of the task, where attention learns what to look for cheaply, then the rest
at T. The mechanism's length-dependent options are those of T throughout, so at the short stage a
local window covers the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from routeformer.runner.jobs import Job
from routeformer.runner.setups import Stage, TaskSetup
from routeformer.train.on_task import ModelSpec, spec_dict, spec_with
from routeformer.train.schedule import Schedule

TASKS = ("lm", "mqar", "listops")
META_DENSITY = 0.1
# Keys a routed topk query reads at long lengths (DSA reads 2048 of 128k, NSA 16 blocks of 64): a
# fixed count, so the routed attention grows as T·K, not T². Below T = 8·64 = 512 it is T/8, as
# compare --quick was measured with.
TOPK_KEYS = 64


@dataclass(frozen=True)
class CompareBudget:
    """A comparison: its tasks (each a TaskSetup, staged or not), seeds, backbone, default mechanisms,
    the layer benchmark's lengths (none: no benchmark) and timing repetitions. `name` prefixes every
    run key; `corpus` is the LM's when none is asked (None: `default_corpus()`), and named in the LM
    runs' keys where `corpus_in_keys` (the long budget's keys never named it); `keep_models`: each
    run's trained model is kept as a task run directory `<out>/models/<key>` (runner/jobs.py)."""
    name: str
    tasks: dict[str, TaskSetup]
    seeds: int = 3
    spec: ModelSpec = field(default_factory=ModelSpec)
    mechanisms: tuple[str, ...] | None = None  # the default selection; None = every registered one
    bench_lengths: tuple[int, ...] = (1024, 4096)
    repeats: int = 5
    corpus: str | None = "pydoc"
    corpus_in_keys: bool = True
    keep_models: bool = False


# Quick: the setups below were chosen on validation accuracy of `full` (seeds 0-2), never on the
# test numbers the report shows. MQAR: plain attention learns it through a phase transition whose
# timing varies by seed; at T = 32 with 4 pairs it came within 600 steps for every seed only with a
# small vocabulary (16: 7 keys, 8 values) and a long warm-up (200 steps); with vocabulary 32 or a
# 50-100-step warm-up, seeds 1-2 stayed at 1/pairs. ListOps: T = 32 holds the short expressions
# (mean 14 tokens), half the cost of T = 64 at the same rule baselines. The mechanisms are the
# subset that fits in 10 minutes on 2 cores (see README).
QUICK = CompareBudget(
    "quick",
    tasks={
        "lm": TaskSetup({"corpus": "pydoc", "seq_len": 128},
                        Schedule(steps=300, batch_size=32, lr=3e-3, warmup_steps=30), test_sequences=256),
        "mqar": TaskSetup({"seq_len": 32, "pairs": 4, "vocab_size": 16},
                          Schedule(steps=600, batch_size=64, lr=3e-3, warmup_steps=200)),
        "listops": TaskSetup({"seq_len": 32, "max_length": 31},
                             Schedule(steps=1200, batch_size=64, lr=3e-3, warmup_steps=100)),
    },
    spec=ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary"),
    # MiTA left out for time: with it the quick budget took 11.8 min on 2 idle cores (706 s in
    # compare); `--mechanisms full linear local topk mita` runs it at the same setups.
    mechanisms=("full", "linear", "local", "topk"),
    bench_lengths=(1024, 4096), repeats=5,
)
FULL = CompareBudget(
    "full",
    tasks={
        "lm": TaskSetup({"corpus": "pydoc", "seq_len": 256},
                        Schedule(steps=1500, batch_size=32, lr=3e-3, warmup_steps=100), test_sequences=512),
        "mqar": TaskSetup({"seq_len": 64, "pairs": 8, "vocab_size": 64},
                          Schedule(steps=3000, batch_size=64, lr=3e-3, warmup_steps=200)),
        "listops": TaskSetup({"seq_len": 128, "max_length": 127, "max_depth": 4},
                             Schedule(steps=2000, batch_size=64, lr=3e-3, warmup_steps=200)),
    },
    spec=ModelSpec(dim=128, depth=2, heads=4, mlp_ratio=2.0, positions="rotary"),
    bench_lengths=(1024, 4096, 16384), repeats=5,
)


LONG_MECHANISMS = ("full", "linear", "local", "topk", "mita", "meta", "meta_tokens", "expanding")
EVAL_MULTIPLES = (2, 4)  # evaluated (forward only) at these multiples of the training length


TEST_TOKENS = 262_144  # tokens of the test split a long setup is tested on at every length


def curriculum_setup(options: dict[str, Any], stages: Sequence[Stage], *, evals: int = 2,
                     validation_sequences: int = 64, test_tokens: int = TEST_TOKENS,
                     eval_multiples: tuple[int, ...] = EVAL_MULTIPLES, **more: Any) -> TaskSetup:
    """A long-budget TaskSetup from its stages in order, the last one on the task itself (options
    {}): `evals` evaluations per stage, tested on `test_tokens` tokens at T and at each multiple."""
    *curriculum, last = stages
    if last.options:
        raise ValueError(f"the last stage trains on the task itself (options {{}}); got {last.options}")
    return TaskSetup(options, last.schedule, evals=evals, validation_sequences=validation_sequences,
                     test_sequences=test_tokens // int(options["seq_len"]), curriculum=tuple(curriculum),
                     eval_multiples=eval_multiples, **more)


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
# 0.067 (compare/long-mqar-topk in docs/results/history.md; its routing recall ~0.65 at T = 1024, ~0.17
# at 4096). A dense distillation over every key all run did not help (0.371 / 0.413 on seeds 0 / 1); the
# blind router reached validation 1.0 at T = 1024 and 4096 on seeds 0 and 1
# (`scripts/topk_long_probe.py SEED --option "routing_positions='none'"`). Chosen on those
# validation curves; the T = 512 recall keeps the default (recency solved it on 5 of 5 seeds). Its cost:
# 3.45x full's step at T = 4096 before the routing fixes for tied keys (compare/long-mqar-topk-blind in
# docs/results/history.md): the blind first layer's routing keys take 15 distinct values, and the
# selection kernels slowed down under the ties; after the fixes 0.50x on 5 seeds
# (docs/results/compare/long-mqar-5seeds/README.md).
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
# Stage 1's learning rate is 1e-3 (3e-3 in the T = 4096 run of
# docs/results/compare/long/): at 3e-3 the phase transition failed on some seeds for every mechanism
# (full seed 7, meta's full expert seeds 1 and 3: training loss stuck at ln 4, also over 1200 steps
# or at 1e-2); at 1e-3 full passed on seeds 0-8 and meta's full expert on seeds 0-7 by step 300
# (docs/results/routers.md, `scripts/stage1_probe.py --lr`). The T = 512 stage likewise
# moved from 3e-3 to 1e-3 (15:20): at 3e-3 meta seeds 3 and 4 solved T = 128 and collapsed to chance
# in its first 100 steps; at 1e-3 both reach 1.0 (`scripts/meta_stage3_probe.py`).
_RECALL_WARMUP = (
    Stage({"seq_len": 32, "pairs": 4}, Schedule(steps=600, batch_size=64, lr=1e-3, warmup_steps=200)),
    Stage({"seq_len": 128}, Schedule(steps=150, batch_size=32, lr=3e-3, warmup_steps=30)),
)
LONG = CompareBudget(
    "long",
    tasks={
        # Recall at T = 4096: the T = 512 curriculum, then 1024 and 4096.
        "mqar": curriculum_setup(
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
        "mqar_512": curriculum_setup(
            {"seq_len": 512, "pairs": 7, "vocab_size": 16},
            stages=(*_RECALL_WARMUP,
                    Stage({}, Schedule(steps=200, batch_size=16, lr=1e-3, warmup_steps=20))),
            mechanism_options={"meta": META_RECALL_RECIPE},
            task="mqar",
        ),
        # The earlier long compare's LM: Tiny Shakespeare (or the embedded corpus) at T = 1024.
        "lm": curriculum_setup(
            {"seq_len": 1024},
            stages=(
                Stage({"seq_len": 128}, Schedule(steps=250, batch_size=32, lr=3e-3, warmup_steps=25)),
                Stage({}, Schedule(steps=60, batch_size=8, lr=1e-3, warmup_steps=6)),
            ),
        ),
        # The long-range LM: Python source at T = 4096, evaluated on the files' first 4096 characters
        # (a position is a place in its file) and trained on windows anywhere inside a file. Stage 1
        # learns the characters on random T = 256 windows of the joined training text (cheap); stage 2
        # reads T = 1024 windows, where copying from far back is first worth learning; stage 3 trains
        # at T. Sized to the 2-core machine (docs/results/compare/long-code_lm/README.md); it needs
        # ../shared/data/python-stdlib.
        "code_lm": curriculum_setup(
            {"seq_len": 4096},
            stages=(
                Stage({"seq_len": 256, "documents": "stream"},
                      Schedule(steps=1500, batch_size=32, lr=3e-3, warmup_steps=100)),
                Stage({"seq_len": 1024}, Schedule(steps=3000, batch_size=8, lr=2e-3, warmup_steps=50)),
                Stage({}, Schedule(steps=3000, batch_size=2, lr=1e-3, warmup_steps=50)),
            ),
            evals=4,
        ),
    },
    spec=ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary"),
    mechanisms=LONG_MECHANISMS, bench_lengths=(), repeats=5, corpus=None, corpus_in_keys=False,
    keep_models=True,
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
    chosen = list(mechanisms or LONG.mechanisms or ())
    unknown = [m for m in chosen if m not in registered]
    if unknown:
        raise ValueError(f"mechanisms: unknown {unknown}; registered: {registered}")
    chosen = with_baseline(dict.fromkeys(chosen))
    tasks = list(tasks or default_long_tasks())
    bad = [t for t in tasks if t not in LONG_TASKS]
    if bad:
        raise ValueError(f"tasks: --long has {list(LONG_TASKS)}; got {bad}")
    return chosen, tasks


def options_for(mechanism: str, seq_len: int) -> dict[str, Any]:
    """The length-dependent budgets of the module docstring (the layer's `budget_options` at
    `TOPK_KEYS`); every other option at its default."""
    from routeformer.attention import attention_class

    return attention_class(mechanism).budget_options(seq_len, TOPK_KEYS)


def layer_options(setup: TaskSetup, mechanism: str, seq_len: int) -> dict[str, Any]:
    """The layer options of `mechanism` on the setup's task at `seq_len`: compare's budget there
    (`options_for`), then the setup's recipe for the mechanism."""
    return {**options_for(mechanism, seq_len), **setup.mechanism_options.get(mechanism, {})}


def lm_only(mechanism: str) -> bool:
    """Whether `mechanism` needs injected meta-tokens, so runs on the LM only."""
    from routeformer.attention import attention_class

    return attention_class(mechanism).needs_meta_tokens


def task_options(task: str, mechanism: str, setup: TaskSetup) -> dict[str, Any]:
    """What `build_task` gets for `mechanism`: the setup's options (+ meta-tokens at META_DENSITY for
    a mechanism that needs them, unless the setup states its own density)."""
    if lm_only(mechanism):
        return {**setup.options, "meta_density": setup.options.get("meta_density", META_DENSITY)}
    return dict(setup.options)


def task_job(key: str, task: str, mechanism: str, seed: int, setup: TaskSetup, spec: ModelSpec) -> Job:
    """The run of `mechanism` on `task` (the setup's name in its budget) with `seed` as compare trains
    it: the task built from the setup's options (+ meta-tokens where the mechanism needs them), the
    mechanism's options at the task's length (`options_for`, then the setup's recipe for it), the
    setup's stages and the backbone `spec`."""
    options = task_options(task, mechanism, setup)
    if "seq_len" in options:
        seq_len = int(options["seq_len"])
    else:  # a task whose length follows from other options (the recall tasks)
        from routeformer.tasks import build_task

        seq_len = build_task(setup.task_name(task), **options).seq_len
    return Job(key, task, options, mechanism, layer_options(setup, mechanism, seq_len), seed, setup, spec)


def check_selection(
    mechanisms: Sequence[str] | None, tasks: Sequence[str] | None, budget: CompareBudget | None = None,
) -> tuple[list[str], list[str]]:
    """Validate --mechanisms / --tasks against the registry and the budget's tasks (no budget:
    TASKS); None = the budget's default (all; its mechanisms with `full` first)."""
    from routeformer.attention import baseline_first, list_attentions

    registered = list(list_attentions())
    default = list(budget.mechanisms) if budget is not None and budget.mechanisms else registered
    mechanisms = list(mechanisms or baseline_first(default))
    valid = list(budget.tasks) if budget is not None else list(TASKS)
    tasks = list(tasks or valid)
    unknown = [m for m in mechanisms if m not in registered]
    if unknown:
        raise ValueError(f"mechanisms: unknown {unknown}; registered: {registered}")
    bad_tasks = [t for t in tasks if t not in valid]
    if bad_tasks:
        raise ValueError(f"tasks: unknown {bad_tasks}; valid: {valid}")
    if not mechanisms or not tasks:
        raise ValueError("mechanisms and tasks must each name at least one")
    return mechanisms, tasks


def with_backbone(budget: CompareBudget, changes: dict[str, Any]) -> CompareBudget:
    """`budget` with the backbone fields `changes` names set (`train.on_task.spec_with`: `{"dim": 32}`)
    and, where that changes the backbone, a name that says how (`quick-dim32-depth1`: its runs,
    floors and costs are stored under keys of their own, beside those of the budget's backbone).
    Raises ValueError as `spec_with` does."""
    spec = spec_with(budget.spec, changes)
    tag = "-".join(f"{key}{getattr(spec, key)}" for key in sorted(changes)
                   if getattr(spec, key) != getattr(budget.spec, key))
    return replace(budget, spec=spec, name=f"{budget.name}-{tag}") if tag else budget


def default_corpus() -> str:
    """Tiny Shakespeare where a local copy exists (../shared/data, ROUTEFORMER_DATA_DIR), else the
    embedded corpus: the long compare never downloads."""
    from routeformer.data.corpora import load_corpus

    try:
        load_corpus("tinyshakespeare")
        return "tinyshakespeare"
    except (OSError, ValueError):
        return "pydoc"


def budget_summary(budget: CompareBudget) -> dict[str, Any]:
    """The budget as result.json holds it (a one-stage setup as it read before setups had stages)."""
    return {"name": budget.name, "seeds": budget.seeds, "model": spec_dict(budget.spec),
            "tasks": {task: setup.as_dict() for task, setup in budget.tasks.items()},
            "bench_lengths": list(budget.bench_lengths), "repeats": budget.repeats}
