"""`routeformer reproduce meta-tokens-recall | meta-tokens-ablations | meta-tokens-finetune`:
"Language Modeling with Learned Meta-Tokens" (arXiv 2509.16278) redone on the shared recall tasks.
Each run is one `RecallRun` (experiments/recall_runs.py), trained as a `run_jobs` job; records are
stored under `<out>/../meta-tokens-runs/runs/` and shared by the experiments (the same run is
trained once).

- meta-tokens-recall: list recall, segment counting, parity and copying; `plain` (no `_PAUSE_`,
  `full`), `pause` (`_PAUSE_` closing each segment, `full`: the tokens alone) and `meta` (the same
  tokens and the meta-attention); 3 seeds; test accuracy at the training length and at twice the
  segments, reported apart, beside each task's chance and measured shortcut floor.
- meta-tokens-ablations (copying): the position scheme at meta-tokens (skip / keep / the paper's
  zeroing) and the meta-attention's form (the paper's sequential layout vs the parallel shared
  form), one change at a time from the `meta` run of meta-tokens-recall.
- meta-tokens-finetune (copying): a `full` model pre-trained on the char-LM task without
  meta-tokens, fine-tuned with meta-tokens (`meta`) or without (`plain`), beside the same two
  trained from scratch with the same steps.

The paper fine-tunes GPT-2 124M on these tasks; ours are 2-layer models of about 0.1M parameters
trained for a few hundred steps on a loaded 2-core CPU — a check of direction, not of size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from routeformer.experiments.recall_runs import (
    LENGTH_FACTORS,
    RECALL_SCHEDULE,
    RecallRun,
    floors,
    pretrain_body,
    train_recall,
)
from routeformer.experiments.registry import register_experiment
from routeformer.runner.jobs import Call, call, finished_records, run_jobs, say
from routeformer.runner.report import (
    format_mean_sd,
    markdown_table,
    mean_sd,
    provenance,
    write_result,
)
from routeformer.runner.seeds import over_seeds, seed_grid
from routeformer.runner.setups import Stage
from routeformer.train.schedule import Schedule

# Task settings, small enough for a loaded 2-core machine (docs/results/meta_tokens.md says which
# ones the `plain` baseline lifts above its floor). Copying first: it carries the ablations and the
# fine-tuning; the other three get half the steps (time).
TASK_OPTIONS = {
    "copying": {"segments": 4, "segment_length": 3},
    "parity": {"segments": 4, "segment_length": 2},
    "list_recall": {"segments": 4, "segment_length": 2},
    "segment_counting": {"segments": 4, "segment_length": 3},
}
HALF_STEPS = ("parity", "list_recall", "segment_counting")
ABLATION_TASK = "copying"


@dataclass(frozen=True)
class Settings:
    tasks: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    pretrain_steps: tuple[int, ...]  # one pre-trained body per seed and entry
    validation_sequences: int = 256
    test_sequences: int = 512


def settings(quick: bool) -> Settings:
    if quick:
        return Settings(("copying",), (0,), 20, (10,), validation_sequences=64, test_sequences=64)
    return Settings(tuple(TASK_OPTIONS), (0, 1, 2), 800, (300, 400))


def run_key(run: RecallRun) -> str:
    options = "x".join(str(run.task_options[name]) for name in sorted(run.task_options))
    init = "-ft" + Path(run.init).stem if run.init else ""
    stages = "".join("-after" + "x".join(f"{k}{v}" for k, v in sorted(stage.options.items()))
                     + f"s{stage.schedule.steps}lr{stage.schedule.lr:g}" for stage in run.curriculum)
    return (f"{run.task}{options}-{run.variant}-{run.positions}-s{run.seed}-{run.schedule.steps}{init}"
            f"{stages}")


def _runs_dir(out_dir: Path) -> Path:
    return out_dir.parent / "meta-tokens-runs"


def base_run(task: str, variant: str, seed: int, s: Settings, **changes) -> RecallRun:
    steps = max(1, s.steps // 2) if task in HALF_STEPS else s.steps
    return RecallRun(task, TASK_OPTIONS[task], variant=variant, seed=seed,
                     schedule=replace(RECALL_SCHEDULE, steps=steps),
                     validation_sequences=s.validation_sequences, test_sequences=s.test_sequences, **changes)


def train_logged(run: RecallRun) -> dict[str, Any]:
    """`train_recall(run)`, its progress lines on stderr under the run's key."""
    key = run_key(run)
    return train_recall(run, log=lambda line: say(f"{key}: {line}"))


def train_all(out_dir: Path, runs: list[RecallRun], quick: bool) -> list[dict[str, Any]]:
    """The record of every run, in order: one `run_jobs` sweep (records under `_runs_dir(out_dir)`,
    shared by the experiments; two worker processes of one thread each but at --quick). Raises
    RuntimeError naming the runs that failed."""
    jobs = [Call(run_key(run), train_logged, {"run": run}) for run in runs]
    records = finished_records(run_jobs(_runs_dir(out_dir), list({job.key: job for job in jobs}.values()),
                                        1 if quick else 2, say, train=call), "meta-tokens")
    return [records[job.key] for job in jobs]


def pretrain_logged(path: Path, seed: int, steps: int, spec: Any) -> dict[str, Any]:
    """`pretrain_body` of a fine-tuning run's body, its progress lines on stderr."""
    return pretrain_body(path, seed, steps, spec, log=lambda line: say(f"pretrain {path.stem}: {line}"))


def by_seed(records: list[dict[str, Any]], seeds: int) -> list[list[dict[str, Any]]]:
    """`records` of runs listed variant by variant, `seeds` runs each, as one list per variant."""
    return [records[start:start + seeds] for start in range(0, len(records), seeds)]


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"seeds": [r["run"]["seed"] for r in records],
                           "parameters": sorted({r["parameters"] for r in records})}
    for factor in LENGTH_FACTORS:
        for split in ("validation", "test"):
            values = [r[f"{split}_{factor}x"] for r in records]
            mean, sd = mean_sd(values)
            out[f"{split}_{factor}x"] = {"values": values, "mean": mean, "sd": sd}
    return out


def _row(label: str, stats: dict[str, Any]) -> list[Any]:
    def cell(key: str) -> str:
        values = stats[key]["values"]
        return format_mean_sd(values)
    return [label, "/".join(str(p) for p in stats["parameters"]), cell("validation_1x"), cell("test_1x"),
            cell("validation_2x"), cell("test_2x")]


HEADER = ["variant", "parameters", "validation 1×", "**test 1×**", "validation 2×", "**test 2×**"]


def _floor_line(run: RecallRun, seq_lens: dict[str, int]) -> tuple[str, dict[str, Any]]:
    measured = floors(run)
    parts = [f"{factor} (T = {seq_lens[factor]} as the first row reads it): chance {values['chance']:.3f}, "
             f"shortcut floor "
             f"{values['floor']:.3f}" for factor, values in measured.items()]
    text = "Chance and floor (best measured shortcut rule, test split) at " + "; at ".join(parts) + "."
    return text, measured


def _grid(out_dir: Path, s: Settings, task: str, variants: list[tuple[str, dict[str, Any]]], quick: bool
          ) -> tuple[list[list[Any]], dict[str, Any]]:
    runs = [base_run(task, changes.get("variant", "meta"), seed, s,
                     **{k: v for k, v in changes.items() if k != "variant"})
            for (_, changes), seed in seed_grid(variants, s.seeds, seed_major=False)]
    return _rows(zip([label for label, _ in variants], by_seed(train_all(out_dir, runs, quick), len(s.seeds)),
                     strict=True))


def _rows(labelled: Any) -> tuple[list[list[Any]], dict[str, Any]]:
    """Markdown rows and results of (label, records over the seeds) pairs."""
    rows, results = [], {}
    for label, records in labelled:
        results[label] = summary(records)
        results[label]["seq_len"] = {f"{f}x": records[0][f"seq_len_{f}x"] for f in LENGTH_FACTORS}
        rows.append(_row(label, results[label]))
    return rows, results


def _setup_line(s: Settings) -> str:
    spec = RecallRun("copying", {}).spec
    return (f"Models: {spec.depth} layers, D = {spec.dim}, {spec.heads} heads, MLP ×{spec.mlp_ratio}, "
            f"rotary positions; AdamW lr 3e-3, batch 32, {s.steps} steps ({s.steps // 2} for "
            f"{', '.join(HALF_STEPS)}; warm-up 60, cosine); seeds "
            f"{list(s.seeds)}, mean ± sd. Accuracy of the asked tokens on fixed samples "
            f"({s.validation_sequences} validation, {s.test_sequences} test sequences); 2× = twice the "
            "segments, never trained on. Positions: `skip` (meta-tokens do not advance the position "
            "counter) unless a row says otherwise. Every variant of a seed sees the same sequences.")


RECALL_VARIANTS = [
    ("plain: no `_PAUSE_`, `full`", {"variant": "plain"}),
    ("pause: `_PAUSE_`, `full` (no meta-attention)", {"variant": "pause"}),
    ("meta: `_PAUSE_` + meta-attention", {"variant": "meta"}),
]


@register_experiment("meta-tokens-recall",
                     "recall tasks (no shortcuts) with vs without meta-tokens, 1x and 2x")
def run_recall(out_dir: Path, quick: bool) -> Path:
    s = settings(quick)
    sections, results = [], {}
    for task in s.tasks:
        rows, results[task] = _grid(out_dir, s, task, RECALL_VARIANTS, quick)
        seq_lens = next(iter(results[task].values()))["seq_len"]
        line, results[task]["floors"] = _floor_line(base_run(task, "plain", 0, s), seq_lens)
        sections += [f"## {task} {TASK_OPTIONS[task]}", "", line, "", markdown_table(HEADER, rows), ""]
    command = "routeformer reproduce meta-tokens-recall" + (" --quick" if quick else "")
    markdown = "\n".join(["# meta-tokens-recall", "", provenance(command), "", _setup_line(s), "", *sections])
    return write_result(out_dir, {"settings": s.__dict__, "task_options": TASK_OPTIONS, "results": results},
                        markdown)


ABLATION_VARIANTS = [
    ("meta, positions skip (as in meta-tokens-recall)", {"variant": "meta"}),
    ("meta, positions keep", {"variant": "meta", "positions": "keep"}),
    ("meta, positions zeroed at meta-tokens (the paper's)", {"variant": "meta", "positions": "zero"}),
    ("meta, parallel shared-Q/K/V form (the earlier layer)", {"variant": "meta_parallel"}),
    # one change from the zeroed row: the meta-attention removed
    ("pause (no meta-attention), positions zeroed at meta-tokens", {"variant": "pause", "positions": "zero"}),
]


@register_experiment("meta-tokens-ablations",
                     "copying: position scheme at meta-tokens; sequential vs parallel form")
def run_ablations(out_dir: Path, quick: bool) -> Path:
    s = settings(quick)
    rows, results = _grid(out_dir, s, ABLATION_TASK, ABLATION_VARIANTS, quick)
    seq_lens = next(iter(results.values()))["seq_len"]
    line, results["floors"] = _floor_line(base_run(ABLATION_TASK, "plain", 0, s), seq_lens)
    command = "routeformer reproduce meta-tokens-ablations" + (" --quick" if quick else "")
    markdown = "\n".join([
        "# meta-tokens-ablations", "", provenance(command), "", _setup_line(s), "",
        f"Task: {ABLATION_TASK} {TASK_OPTIONS[ABLATION_TASK]}. Each row changes one thing from the first, "
        "except the last, which changes one thing from the zeroed row.",
        "", line, "", markdown_table(HEADER, rows), ""])
    return write_result(out_dir, {"settings": s.__dict__, "results": results}, markdown)


@register_experiment("meta-tokens-finetune",
                     "pre-train without meta-tokens (char LM), fine-tune with vs without")
def run_finetune(out_dir: Path, quick: bool) -> Path:
    s = settings(quick)
    bodies = _runs_dir(out_dir) / "bodies"
    spec = RecallRun(ABLATION_TASK, {}).spec
    paths = {(steps, seed): bodies / f"lm-full-s{seed}-{steps}.pt"
             for steps, seed in seed_grid(s.pretrain_steps, s.seeds, seed_major=False)}
    bodies_jobs = [Call(f"pretrain-{path.stem}", pretrain_logged,
                        {"path": path, "seed": seed, "steps": steps, "spec": spec})
                   for (steps, seed), path in paths.items()]
    for job in bodies_jobs:  # a record kept without its weights: train the body again
        if not job.arguments["path"].exists():
            (_runs_dir(out_dir) / "runs" / f"{job.key}.json").unlink(missing_ok=True)
    records = finished_records(run_jobs(_runs_dir(out_dir), bodies_jobs, 1 if quick else 2, say, train=call),
                               "meta-tokens-finetune")
    pretrained = {job.arguments["path"].stem: records[job.key] for job in bodies_jobs}
    starts = [("scratch", None)] + [(f"pre-trained {steps} steps", steps) for steps in s.pretrain_steps]
    variants = [(variant, start, steps) for variant in ("plain", "meta") for start, steps in starts]
    labels = [f"{variant}, {start}" for variant, start, _ in variants]
    runs = [replace(base_run(ABLATION_TASK, variant, seed, s),
                    init=None if steps is None else str(paths[steps, seed]))
            for (variant, _, steps), seed in seed_grid(variants, s.seeds, seed_major=False)]
    rows, results = _rows(zip(labels, by_seed(train_all(out_dir, runs, quick), len(s.seeds)), strict=True))
    line, results["floors"] = _floor_line(base_run(ABLATION_TASK, "plain", 0, s),
                                          next(iter(results.values()))["seq_len"])
    bits = {steps: format_mean_sd(over_seeds(lambda seed, steps=steps: pretrained[f"lm-full-s{seed}-{steps}"]
                                             ["validation_history"][-1]["bits_per_char"], s.seeds))
            for steps in s.pretrain_steps}
    command = "routeformer reproduce meta-tokens-finetune" + (" --quick" if quick else "")
    markdown = "\n".join([
        "# meta-tokens-finetune", "", provenance(command), "", _setup_line(s), "",
        "Pre-training: `full`, the same backbone, char-LM task (corpus pydoc, T = 128, batch 32, lr 3e-3), "
        f"{' or '.join(map(str, s.pretrain_steps))} steps, one body per seed, no meta-tokens; validation "
        f"bits/char at the end: {', '.join(f'{k} steps {v}' for k, v in bits.items())}. "
        "Fine-tuning loads the blocks and final norm (embeddings and head are new: the vocabularies "
        "differ; the meta-attention's output projection starts at zero) and trains on "
        f"{ABLATION_TASK} {TASK_OPTIONS[ABLATION_TASK]} exactly as the scratch runs.", "",
        line, "", markdown_table(HEADER, rows), ""])
    result = {"settings": s.__dict__, "pretrain": pretrained, "results": results}
    return write_result(out_dir, result, markdown)


# The paper's length claim at its own length: trained at T = 512, evaluated at 1024. Copying
# (the one task the plain model learns here) with 128 segments of 2 items: 515 tokens without
# `_PAUSE_` (643 with), 2x = 256 segments (1,027 / 1,283 tokens). Trained from scratch at T = 515,
# plain stayed at chance over 800 steps (probe, seed 0: 0.023 at step 600); so a curriculum, as the
# long compare's recall has. 1000 steps on 4 segments at lr 3e-3 (plain seeds 1-2 and meta seeds 0-1
# reach 1.0 on validation by step 600-1000), then the longer stages at lr 1e-3: with 600 short steps
# and 3e-3 at T = 515, plain seed 0 fell from 1.0 to chance in its first 75 steps there (the collapse
# the long compare's recall showed at 3e-3). Chosen on those validation curves only.
LONG_COPYING = {"segments": 128, "segment_length": 2}
LONG_CURRICULUM = (
    Stage({"segments": 4}, Schedule(steps=1000, batch_size=32, lr=3e-3, warmup_steps=60)),
    Stage({"segments": 32}, Schedule(steps=150, batch_size=32, lr=1e-3, warmup_steps=15)),
)
LONG_SCHEDULE = Schedule(steps=300, batch_size=32, lr=1e-3, warmup_steps=30)


def long_run(variant: str, seed: int, quick: bool) -> RecallRun:
    if quick:
        short = Schedule(steps=10, batch_size=32, lr=3e-3, warmup_steps=2)
        return RecallRun("copying", {"segments": 8, "segment_length": 2}, variant=variant, seed=seed,
                         schedule=short, curriculum=(Stage({"segments": 4}, short),),
                         validation_sequences=32, test_sequences=32)
    return RecallRun("copying", LONG_COPYING, variant=variant, seed=seed, schedule=LONG_SCHEDULE,
                     curriculum=LONG_CURRICULUM)


@register_experiment("meta-tokens-recall-512",
                     "copying trained at T=512 (128 segments, after 600 steps on 4), tested at T and 2T: "
                     "plain vs `_PAUSE_` vs meta-tokens, 3 seeds")
def run_recall_long(out_dir: Path, quick: bool) -> Path:
    seeds = (0,) if quick else (0, 1, 2)
    runs = [long_run(changes["variant"], seed, quick)
            for (_, changes), seed in seed_grid(RECALL_VARIANTS, seeds, seed_major=False)]
    rows, results = _rows(zip([label for label, _ in RECALL_VARIANTS],
                              by_seed(train_all(out_dir, runs, quick), len(seeds)), strict=True))
    example = long_run("plain", 0, quick)
    line, results["floors"] = _floor_line(example, next(iter(results.values()))["seq_len"])
    spec, schedule = example.spec, example.schedule
    stages = "; ".join(f"{stage.schedule.steps} steps at lr {stage.schedule.lr:g} on "
                       f"{stage.options['segments']} segments" for stage in example.curriculum)
    command = "routeformer reproduce meta-tokens-recall-512" + (" --quick" if quick else "")
    markdown = "\n".join([
        "# meta-tokens-recall-512: the paper's 512 → 1024 on copying", "", provenance(command), "",
        f"Task: copying {example.task_options} ({LENGTH_FACTORS[-1]}× = twice the segments, never trained "
        f"on). Models: {spec.depth} layers, D = {spec.dim}, {spec.heads} heads, MLP ×{spec.mlp_ratio}, "
        f"rotary positions, `skip` positions at meta-tokens; AdamW, batch {schedule.batch_size}, each stage "
        f"with its own warm-up and cosine decay: {stages}; then {schedule.steps} at lr {schedule.lr:g} "
        f"at the training length; seeds {list(seeds)}, mean ± sd; every variant of a seed "
        "sees the same sequences. `plain` reads them without the `_PAUSE_` columns.", "",
        line, "", markdown_table(HEADER, rows), ""])
    result = {"seeds": list(seeds), "task_options": example.task_options, "steps": schedule.steps,
              "curriculum": [[stage.options, asdict(stage.schedule)] for stage in example.curriculum],
              "results": results}
    return write_result(out_dir, result, markdown)
