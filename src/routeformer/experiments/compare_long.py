"""`routeformer compare --long`: quality and cost of every mechanism at lengths where routing pays.

`compare --quick` trains at T = 32-128, where no routed layer saves anything; the layer benchmarks
measure savings at 4k-64k, where no model was trained. This budget joins them: each task is trained
at a long length T (an associative-recall task at T = 512, a character LM at T = 1024), evaluated on
its test split at T and, forward only, at 2T and 4T (reported apart: the length-generalisation
claims of the meta-token and expanding-attention papers), and each mechanism's cost is measured at
the same lengths in the same report: training step time and inference time per sequence, both
alternating with `full` in the same rounds, executed attention FLOPs, and peak memory.

The machinery is compare's (experiments/jobs.py): one job per (task, mechanism, seed), the same
batches per seed for every mechanism, the same backbone, finished runs kept on disk (a killed run
resumes after its last evaluation), chance and shortcut rules beside every number.

Training follows a curriculum (`Stage`s): most steps on a short, easy version of the task, where
attention learns what to look for cheaply, then the rest at T. The mechanism's length-dependent options
(window T/4, top-k T/8, ...) are those of T throughout, so at the short stage a local window covers
the whole sequence. Each stage restarts AdamW's schedule (warm-up and cosine decay).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from routeformer.experiments.compare import options_for, task_options
from routeformer.experiments.jobs import TaskSetup, say
from routeformer.train.on_task import ModelSpec

LONG_MECHANISMS = ("full", "linear", "local", "topk", "mita", "meta", "meta_tokens", "expanding")
EVAL_MULTIPLES = (2, 4)  # evaluated (forward only) at these multiples of the training length


@dataclass(frozen=True)
class Stage:
    """A curriculum stage: `steps` steps of batch `batch_size` on the task built with `options`
    overriding the training setup's (e.g. a shorter seq_len, fewer MQAR pairs; {}: the task itself)."""

    options: dict[str, Any]
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int


@dataclass(frozen=True)
class LongSetup:
    """One task of the long budget: what `build_task` gets at the training length, its stages."""

    options: dict[str, Any]
    stages: tuple[Stage, ...]
    evals_per_stage: int = 2
    validation_sequences: int = 64
    test_tokens: int = 262_144  # tokens of the test split evaluated at every length
    cost_batch: int = 4  # sequences per inference call when timing

    @property
    def seq_len(self) -> int:
        return int(self.options["seq_len"])

    def as_task_setup(self) -> TaskSetup:
        """The last stage as compare's TaskSetup (task_options and the report read it)."""
        last = self.stages[-1]
        return TaskSetup(
            self.options,
            steps=sum(s.steps for s in self.stages),
            batch_size=last.batch_size,
            lr=last.lr,
            warmup_steps=last.warmup_steps,
            validation_sequences=self.validation_sequences,
            test_sequences=self.test_tokens // self.seq_len,
        )


@dataclass(frozen=True)
class LongJob:
    key: str
    task: str
    task_options: dict[str, Any]
    mechanism: str
    options: dict[str, Any]
    seed: int
    setup: LongSetup
    spec: ModelSpec = field(default_factory=ModelSpec)


def train_long_job(job: LongJob) -> dict[str, Any]:
    """Train one fresh model through the job's stages; test it at T, 2T and 4T."""
    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model, evaluate_on_task, parameter_count
    from routeformer.train.task_loop import TaskTrainConfig, train_task

    task = build_task(job.task, **job.task_options)
    torch.manual_seed(job.seed)
    model = build_task_model(task, job.mechanism, job.options, job.spec)

    def forward(model, inputs, labels):
        return model(inputs, labels, mask=stage_task.mask(inputs), logits_at_labels=True)

    validation, train_seconds, done = [], 0.0, 0
    total = sum(stage.steps for stage in job.setup.stages)
    say(f"  {job.key}: started ({total} steps in {len(job.setup.stages)} stages)")
    for index, stage in enumerate(job.setup.stages):
        stage_task = build_task(job.task, **{**job.task_options, **stage.options})
        length = stage_task.seq_len
        config = TaskTrainConfig(
            steps=stage.steps,
            batch_size=stage.batch_size,
            lr=stage.lr,
            warmup_steps=stage.warmup_steps,
            seed=job.seed,
            eval_every=max(1, stage.steps // job.setup.evals_per_stage),
        )
        sequences = max(8, job.setup.validation_sequences * task.seq_len // length)
        history = train_task(
            model,
            lambda batch_size, generator, t=stage_task: t.batch(batch_size, generator, "train"),
            lambda m, t=stage_task, n=sequences: evaluate_on_task(m, t, "validation", n),
            config,
            forward=forward,
            log=lambda line, d=done, T=length: say(f"  {job.key}: T={T} {_progress(line, d, total)}"),
        )
        validation += [{**record, "stage": index, "task": stage_task.describe()} for record in history.evals]
        train_seconds += history.train_seconds
        done += stage.steps
    tests = {}
    for multiple in (1, *EVAL_MULTIPLES):
        length = task.seq_len * multiple
        eval_task = build_task(job.task, **{**job.task_options, "seq_len": length})
        began = time.perf_counter()
        tests[str(length)] = {
            **evaluate_on_task(model, eval_task, "test", max(4, job.setup.test_tokens // length)),
            "seconds": time.perf_counter() - began,
        }
    return {
        "task": task.describe(),
        "task_name": job.task,
        "task_options": job.task_options,
        "mechanism": job.mechanism,
        "options": job.options,
        "seed": job.seed,
        "model": asdict(job.spec),
        "stages": [asdict(stage) for stage in job.setup.stages],
        "parameters": parameter_count(model),
        "validation": validation,
        "tests": tests,
        "quality": tests[str(task.seq_len)][task.metric],
        "train_seconds": train_seconds,
    }


def _progress(line: str, done: int, total: int) -> str:
    """`step=150 ...` of a stage -> `step=150 (650/1800) ...`: how far the whole run is."""
    head, _, rest = line.partition(" ")
    if not head.startswith("step="):
        return line
    return f"{head} ({done + int(head[5:])}/{total}) {rest}"


def long_jobs(
    tasks: dict[str, LongSetup], mechanisms: list[str], seeds: int, spec: ModelSpec, corpus: str
) -> list[LongJob]:
    """One job per (task, mechanism, seed); meta_tokens on the LM only (it needs injected tokens)."""
    jobs = []
    for task, setup in tasks.items():
        options = {**setup.options, "corpus": corpus} if task == "lm" else dict(setup.options)
        setup = LongSetup(
            options,
            setup.stages,
            setup.evals_per_stage,
            setup.validation_sequences,
            setup.test_tokens,
            setup.cost_batch,
        )
        for mechanism in mechanisms:
            if task != "lm" and mechanism == "meta_tokens":
                continue
            built = task_options(task, mechanism, setup.as_task_setup())
            for seed in range(seeds):
                jobs.append(
                    LongJob(
                        f"long-{task}-{mechanism}-seed{seed}",
                        task,
                        built,
                        mechanism,
                        options_for(mechanism, setup.seq_len),
                        seed,
                        setup,
                        spec,
                    )
                )
    return jobs


def measure_long_costs(
    task_name: str,
    mechanism: str,
    setup: LongSetup,
    spec: ModelSpec,
    task_options_of: Callable[[str], dict[str, Any]],
    repeats: int,
) -> dict[str, Any]:
    """Training-step and inference time of `mechanism` and of `full`, alternating in the same rounds
    (one thread, as training ran), at T (training) and at T, 2T, 4T (inference per sequence); the
    ratio is the median of the per-round ratios; peak memory of one training step at T."""
    from routeformer.bench.timing import peak_memory_mib, ratio_quartiles, round_times
    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model

    def model_for(name: str, task):
        torch.manual_seed(0)
        return build_task_model(task, name, options_for(name, setup.seq_len), spec)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        names = ["full"] if mechanism == "full" else ["full", mechanism]
        tasks = {name: build_task(task_name, **task_options_of(name)) for name in names}
        models = {name: model_for(name, tasks[name]) for name in names}
        batch = setup.stages[-1].batch_size
        data = {name: tasks[name].batch(batch, torch.Generator().manual_seed(1), "train") for name in names}

        def step(name: str) -> Callable[[], None]:
            def run() -> None:
                models[name].train()
                models[name].zero_grad(set_to_none=True)
                inputs, labels = data[name]
                models[name](inputs, labels, logits_at_labels=True).total_loss.backward()

            return run

        rounds = round_times({name: step(name) for name in names}, repeats, warmup=1)
        costs: dict[str, Any] = {
            "train_ms_per_step": 1000 * _median(rounds[mechanism]),
            "full_train_ms_per_step": 1000 * _median(rounds["full"]),
            "train_time_vs_full": ratio_quartiles(rounds[mechanism], rounds["full"])[1],
            "peak_mib": peak_memory_mib(step(mechanism)),
            "inference": {},
        }
        for multiple in (1, *EVAL_MULTIPLES):
            length = setup.seq_len * multiple
            batches = {}
            for name in names:
                longer = build_task(task_name, **{**task_options_of(name), "seq_len": length})
                batches[name] = longer.batch(setup.cost_batch, torch.Generator().manual_seed(2), "test")[0]

            def infer(name: str, batches=batches) -> Callable[[], None]:
                def run() -> None:
                    models[name].eval()
                    with torch.no_grad():
                        models[name](batches[name])

                return run

            rounds = round_times({name: infer(name) for name in names}, repeats, warmup=1)
            costs["inference"][str(length)] = {
                "infer_ms_per_seq": 1000 * _median(rounds[mechanism]) / setup.cost_batch,
                "full_infer_ms_per_seq": 1000 * _median(rounds["full"]) / setup.cost_batch,
                "infer_time_vs_full": ratio_quartiles(rounds[mechanism], rounds["full"])[1],
            }
    finally:
        torch.set_num_threads(threads)
    return costs


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


@dataclass(frozen=True)
class LongBudget:
    tasks: dict[str, LongSetup]
    spec: ModelSpec
    seeds: int = 3
    mechanisms: tuple[str, ...] = LONG_MECHANISMS
    repeats: int = 5


# Chosen on validation (accuracy / bits per character of `full`), never on the test numbers the report
# shows; the probes are listed in docs/results/compare/long/README.md. MQAR: attention learns it through
# a phase transition that a small vocabulary and a long warm-up make reliable (compare --quick's setup,
# stage 1); once learnt at T=32 the lookup carries to T=128 and T=512 within a few dozen steps, while a
# model started at T=512, or with vocabulary 32-64, stayed at the key-blind level in the probes. Seven
# pairs is what vocabulary 16 holds; queries sit uniformly over the context, so most are further from
# their key than a T/4 window reaches.
LONG = LongBudget(
    tasks={
        "mqar": LongSetup(
            {"seq_len": 512, "pairs": 7, "vocab_size": 16},
            stages=(
                Stage({"seq_len": 32, "pairs": 4}, steps=600, batch_size=64, lr=3e-3, warmup_steps=200),
                Stage({"seq_len": 128}, steps=150, batch_size=32, lr=3e-3, warmup_steps=30),
                Stage({}, steps=200, batch_size=16, lr=3e-3, warmup_steps=20),
            ),
        ),
        "lm": LongSetup(
            {"seq_len": 1024},
            stages=(
                Stage({"seq_len": 128}, steps=250, batch_size=32, lr=3e-3, warmup_steps=25),
                Stage({}, steps=60, batch_size=8, lr=1e-3, warmup_steps=6),
            ),
        ),
    },
    spec=ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary"),
)
LONG_TASKS = tuple(LONG.tasks)


def check_long_selection(
    mechanisms: list[str] | None, tasks: list[str] | None
) -> tuple[list[str], list[str]]:
    """--mechanisms / --tasks for the long budget; None = its defaults. `full` always runs first
    (every ratio and Δ is against it)."""
    from routeformer.attention import list_attentions

    registered = list(list_attentions())
    chosen = list(mechanisms or LONG.mechanisms)
    unknown = [m for m in chosen if m not in registered]
    if unknown:
        raise ValueError(f"mechanisms: unknown {unknown}; registered: {registered}")
    chosen = ["full", *[m for m in dict.fromkeys(chosen) if m != "full"]]
    tasks = list(tasks or LONG_TASKS)
    bad = [t for t in tasks if t not in LONG_TASKS]
    if bad:
        raise ValueError(f"tasks: --long has {list(LONG_TASKS)}; got {bad}")
    return chosen, tasks
