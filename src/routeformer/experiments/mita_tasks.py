"""MiTA on the shared ListOps task: `routeformer reproduce mita-listops`.

One setup, LISTOPS below: the `listops` task (bidirectional, LRA's grammar) at a length
where plain attention clears the task's shortcut rules at this budget, the compare backbone
(2 layers, D = 64, 2 heads, rotary), the same batches per seed for every mechanism, validation
during training, test once at the end.

- full / linear / local (w = T/4) / MiTA (m = k = T/8), 3 seeds, mean ± sd, beside chance and the
  shortcut rules; parameters and executed attention FLOPs per mechanism.
- Paper Fig. 7: the MiTA models evaluated with other landmark
  counts m and expert sizes k (changed at inference with `set_budget`), against models *trained*
  at those budgets; and Fig. 8: MiTA-trained weights evaluated with full attention and
  full-trained weights evaluated with MiTA (the two layers have the same parameters).

Every model trains through the one runner (`run_jobs`, records under out/runs): a killed run resumes
after its finished runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from routeformer.compare.report import task_floor
from routeformer.compare.stats import separated
from routeformer.experiments.registry import register_experiment
from routeformer.runner.jobs import Job, TaskSetup, cached_run, finished_records, run_jobs, say, train_job
from routeformer.runner.report import markdown_table, mean_sd, provenance, write_result
from routeformer.runner.seeds import over_seeds, seed_grid
from routeformer.train.on_task import ModelSpec, build_task_model, evaluate_on_task, spec_dict
from routeformer.train.schedule import Schedule

SEQ_LEN = 32
# compare --quick's ListOps setup (chosen there on the validation accuracy of `full`, seeds 0-2): the
# MiTA runs below are those of the quick compare plus their Fig. 7/8 evaluations. T = 64 cleared the
# flat rule as well on validation (full, seed 0: 0.527 vs 0.434 at step 900) but costs twice as much:
# more than this 2-core machine could give while it was shared.
LISTOPS = TaskSetup({"seq_len": SEQ_LEN, "max_length": SEQ_LEN - 1},
                    Schedule(steps=1200, batch_size=64, lr=3e-3, warmup_steps=100),
                    validation_sequences=256, test_sequences=1024)
# The same task at twice the length (where MiTA's budget T/8 saves more), run after the T = 32
# results were in; the setup is the T = 32 one with only the length changed (full, seed 0, cleared
# the flat rule on validation there: 0.527 vs 0.434 at step 900).
LONG_LISTOPS = TaskSetup({"seq_len": 64, "max_length": 63},
                         Schedule(steps=1200, batch_size=64, lr=3e-3, warmup_steps=100),
                         validation_sequences=256, test_sequences=1024)
QUICK_LISTOPS = TaskSetup({"seq_len": 32, "max_length": 31, "pool": 2000},
                          Schedule(steps=20, batch_size=16, lr=3e-3, warmup_steps=2),
                          evals=1, validation_sequences=32, test_sequences=64)
SPEC = ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary")
SEEDS = (0, 1, 2)
PAPER_LISTOPS = {"full": 37.10, "mita": 37.20}  # LRA ListOps accuracy (%), MiTA paper Table 5
# Fig. 8: each trained model evaluated with the other mechanism (the two layers have the same parameters).
WEIGHT_SWAPS = {"full": "mita", "mita": "full"}


def _setup(mode: str) -> tuple[TaskSetup, tuple[int, ...]]:
    """mode: "quick" (smoke test), "default" (T = 32) or "long" (T = 64)."""
    return {"quick": (QUICK_LISTOPS, (0,)), "default": (LISTOPS, SEEDS), "long": (LONG_LISTOPS, SEEDS)}[mode]


def mechanisms(seq_len: int) -> dict[str, tuple[str, dict[str, Any]]]:
    budget = max(1, seq_len // 8)  # compare's budgets (`options_for`)
    return {"full": ("full", {}), "linear": ("linear", {}),
            "local": ("local", {"window": max(1, seq_len // 4)}),
            "mita": ("mita", {"landmarks": budget, "topk": budget})}


def budget_grid(seq_len: int) -> list[tuple[int, int]]:
    """(m, k) evaluated on the model trained at m = k = T/8: m varied at k = T/8, k varied at m = T/8,
    and the diagonal — from T/32 to T/2."""
    trained = max(1, seq_len // 8)
    values = sorted({max(1, seq_len // d) for d in (32, 16, 8, 4, 2)})
    grid = [(m, trained) for m in values] + [(trained, k) for k in values] + [(v, v) for v in values]
    return list(dict.fromkeys(grid))


def _mita_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from routeformer.attention.mita import MitaAttention

    return [module for module in model.modules() if isinstance(module, MitaAttention)]


def _evaluate(model, task, setup: TaskSetup) -> dict[str, float]:
    return {"validation": evaluate_on_task(model, task, "validation", setup.validation_sequences)["accuracy"],
            "test": evaluate_on_task(model, task, "test", setup.test_sequences)["accuracy"]}


def figure_evaluations(job: Job, model: torch.nn.Module) -> dict[str, Any]:
    """The Fig. 7 / Fig. 8 evaluations of `job`'s trained `model`: `budget_grid` (a MiTA model at
    each (m, k) of `budget_grid`, restored to the job's budget afterwards) and `swapped` (the weights
    evaluated with the other mechanism of WEIGHT_SWAPS), each with validation and test accuracy."""
    from routeformer.tasks import build_task

    task, setup, extra = build_task(job.task, **job.task_options), job.setup, {}
    layers = _mita_layers(model)
    if layers:  # Fig. 7: a MiTA model at other budgets
        grid = {}
        for m, k in budget_grid(task.seq_len):
            for layer in layers:
                layer.set_budget(landmarks=m, topk=k)
            grid[f"{m},{k}"] = _evaluate(model, task, setup)
        for layer in layers:
            layer.set_budget(landmarks=job.options["landmarks"], topk=job.options["topk"])
        extra["budget_grid"] = grid
    swapped = WEIGHT_SWAPS.get(job.mechanism)
    if swapped is not None:
        other = build_task_model(task, swapped, mechanisms(task.seq_len)[swapped][1], job.spec)
        other.load_state_dict(model.state_dict())  # strict: the two layers share parameter names
        extra["swapped"] = {"evaluated_with": swapped, **_evaluate(other, task, setup)}
    return extra


def train_listops(job: Job) -> dict[str, Any]:
    """`run_jobs`' train for a ListOps job: `train_job`'s record (test accuracy, validation history,
    parameters) with the trained model's `figure_evaluations`."""
    extra: dict[str, Any] = {}
    record = train_job(job, keep_model=lambda model: extra.update(figure_evaluations(job, model)))
    return {**record, **extra}


def trained_variants(seq_len: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """The comparison's `mechanisms` and the MiTA models trained at m = k = T/16 and T/4."""
    extra = {f"mita-m{v}k{v}": ("mita", {"landmarks": v, "topk": v})
             for v in sorted({max(1, seq_len // 16), max(1, seq_len // 4)})}
    return {**mechanisms(seq_len), **extra}


def listops_runs(out_dir: Path, mode: str) -> dict[str, list[dict[str, Any]]]:
    """Every trained model's record by variant (`trained_variants`), one per seed in seed order: one
    `run_jobs` sweep (stored under out_dir/runs/, resumable; two worker processes of one thread each
    but at --quick). Raises RuntimeError naming the runs that failed."""
    setup, seeds = _setup(mode)
    prefix = f"{'quick-' if mode == 'quick' else ''}listops{setup.options['seq_len']}"
    variants = trained_variants(setup.options["seq_len"])
    jobs = [Job(f"{prefix}-{name}-seed{seed}", "listops", dict(setup.options), *variants[name], seed, setup,
                SPEC) for name, seed in seed_grid(list(variants), seeds, seed_major=False)]
    records = finished_records(run_jobs(out_dir, jobs, 1 if mode == "quick" else 2, say, train=train_listops),
                               f"mita-listops ({mode})")
    return {name: over_seeds(lambda seed, name=name: records[f"{prefix}-{name}-seed{seed}"], seeds)
            for name in variants}


def _floor(out: Path, mode: str) -> dict[str, Any]:
    setup, _ = _setup(mode)
    return cached_run(out, f"{'quick-' if mode == 'quick' else ''}listops{setup.options['seq_len']}-floor",
                      lambda: task_floor("listops", setup.options))


def _floor_lines(floor: dict[str, Any]) -> str:
    rules = "; ".join(f"{name}: {value:.3f}" for name, value in floor["baselines"].items())
    return f"Chance (majority value): {floor['chance']:.3f}. Shortcut rules on the test split: {rules}."


def _setup_line(setup: TaskSetup, seeds: tuple[int, ...]) -> str:
    length_note = "" if setup.options["seq_len"] == SEQ_LEN else ", only the length changed here"
    schedule = setup.schedule
    return (f"Task `listops` ({', '.join(f'{k}={v}' for k, v in setup.options.items())}), bidirectional, "
            f"the answer read at a `?` token; {schedule.steps} steps of batch {schedule.batch_size}, "
            f"lr {schedule.lr} ({schedule.warmup_steps} warm-up), AdamW + cosine; backbone "
            f"ModelSpec({', '.join(f'{k}={v!r}' for k, v in spec_dict(SPEC).items())}); "
            f"seeds {list(seeds)}, every "
            "mechanism on the same batches per seed. The setup is `compare --quick`'s ListOps (chosen there "
            f"on full's validation accuracy{length_note}); test accuracy on {setup.test_sequences} held-out "
            "sequences.")


def listops_table(out_dir: Path, mode: str, trained: dict[str, list[dict[str, Any]]]
                  ) -> tuple[list[str], dict[str, Any]]:
    """The comparison's Markdown sections and JSON, from `listops_runs`' records."""
    setup, seeds = _setup(mode)
    runs = {name: trained[name] for name in mechanisms(setup.options["seq_len"])}
    floor = _floor(out_dir, mode)
    best_rule = max(floor["baselines"].values())
    summary = {name: mean_sd([r["quality"] for r in records]) for name, records in runs.items()}
    rows = []
    for name, records in runs.items():
        mean, sd = summary[name]
        rows.append([name, f"{mean:.4f} ± {sd:.4f}", "yes" if mean - 3 * sd > best_rule else "no",
                     records[0]["parameters"], f"{records[0]['attention_flops_per_token']:.4g}",
                     PAPER_LISTOPS.get(name, "-")])
    pairs = [f"{a} / {b}" for i, a in enumerate(summary) for b in list(summary)[i + 1:]
             if len(seeds) > 1 and separated(summary[a], summary[b])]
    markdown = [
        _setup_line(setup, seeds), _floor_lines(floor), "## Test accuracy",
        markdown_table(["mechanism", "test accuracy (mean ± sd)", "above the best rule by > 3 sd",
                        "parameters", "attention FLOPs/token", "paper, LRA ListOps %"], rows),
        f"Pairs separated by more than 3 sd: {', '.join(pairs) or 'none'}. The paper's numbers are LRA "
        "(sequences up to 2k tokens, 96k training expressions, larger models): quoted for reference, not "
        "comparable one to one.",
    ]
    return markdown, {"summary": {k: list(v) for k, v in summary.items()}, "floor": floor, "runs": runs}


def _budget_cell(records: list[dict[str, Any]], grid_key: str, split: str) -> str:
    mean, sd = mean_sd([r["budget_grid"][grid_key][split] for r in records])
    return f"{mean:.3f} ± {sd:.3f}"


def budget_tables(mode: str, runs: dict[str, list[dict[str, Any]]]) -> tuple[list[str], dict[str, Any]]:
    """Fig. 7 and Fig. 8 sections (Markdown) and JSON, from `listops_runs`' records: the comparison's
    MiTA and full runs plus the MiTA runs trained at T/16 and T/4."""
    setup, _ = _setup(mode)
    seq_len = setup.options["seq_len"]
    trained_mita, trained_full = runs["mita"], runs["full"]
    trained_at = {int(name.rpartition("k")[2]): records for name, records in runs.items()
                  if name.startswith("mita-m")}
    trained = max(1, seq_len // 8)
    grid_rows = [[m, k, _budget_cell(trained_mita, f"{m},{k}", "validation"),
                  _budget_cell(trained_mita, f"{m},{k}", "test")] for m, k in budget_grid(seq_len)]
    diagonal_rows = []
    for value, records in trained_at.items():
        mean, sd = mean_sd([r["quality"] for r in records])
        diagonal_rows.append([f"m = k = {value}", _budget_cell(trained_mita, f"{value},{value}", "test"),
                              f"{mean:.3f} ± {sd:.3f}"])
    swap_rows = []
    for name, records in (("mita", trained_mita), ("full", trained_full)):
        own = mean_sd([r["quality"] for r in records])
        other = mean_sd([r["swapped"]["test"] for r in records])
        swap_rows.append([name, f"{own[0]:.3f} ± {own[1]:.3f}", records[0]["swapped"]["evaluated_with"],
                          f"{other[0]:.3f} ± {other[1]:.3f}"])
    markdown = [
        f"## Fig. 7: trained at m = k = {trained}, evaluated at (m, k)",
        "Accuracy mean ± sd over the seeds; the validation column is shown so that nothing is chosen on "
        "test.",
        markdown_table(["m (landmarks)", "k (keys per expert)", "validation", "test"], grid_rows),
        "## Changed at inference vs trained at that budget (test)",
        markdown_table(["budget", f"trained at m = k = {trained}, evaluated there",
                        "trained there"], diagonal_rows),
        "## Fig. 8: weights swapped at inference (test)",
        markdown_table(["trained with", "own test accuracy", "evaluated with", "test accuracy"], swap_rows),
    ]
    return markdown, {"grid_rows": grid_rows, "diagonal_rows": diagonal_rows, "swap_rows": swap_rows,
                      "trained_at": {f"m=k={v}": r for v, r in trained_at.items()}}


@register_experiment("mita-listops", "MiTA on the shared ListOps task: full / linear / local / MiTA with 3 "
                     "seeds beside the shortcut rules; budget changed at inference and weights swapped "
                     "(paper Figs. 7-8)")
def listops(out_dir: Path, quick: bool) -> Path:
    return _report(out_dir, "quick" if quick else "default", "mita-listops", quick)


@register_experiment("mita-listops-long", "mita-listops at T=64 (MiTA m = k = 8): the same comparison, "
                     "budget grid and swaps, 3 seeds")
def listops_long(out_dir: Path, quick: bool) -> Path:
    return _report(out_dir, "quick" if quick else "long", "mita-listops-long", quick)


def _report(out_dir: Path, mode: str, name: str, quick: bool) -> Path:
    runs = listops_runs(out_dir, mode)
    comparison, result = listops_table(out_dir, mode, runs)
    budgets, budget_result = budget_tables(mode, runs)
    markdown = "\n\n".join([f"# {name}: MiTA on the shared ListOps task",
                             provenance(f"routeformer reproduce {name}{' --quick' if quick else ''}"),
                             *comparison, *budgets])
    return write_result(out_dir, {**result, **budget_result}, markdown)
