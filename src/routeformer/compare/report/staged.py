"""A staged task's part of the report (`compare --long`: a curriculum, tests at multiples of T):
per evaluated length, quality (mean ± sd over seeds) beside chance and the shortcut rules, the
paired difference from `full` (per seed: every mechanism saw the same batches), and the cost ratios
measured in the same run — the "where routing pays" table; LM tasks add bits per character per
position bucket and on the copy-predictable characters, and validation along the stage at T.
result.json's `records` hold one record per (task, length, mechanism, seed) (`flat_records`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from routeformer.attention import baseline_name
from routeformer.compare.report.tables import (
    NO_DELTA,
    bucket_cells,
    delta_cell,
    floor_rows,
    mean_sd_cell,
    optional_cell,
    ratio_cell,
    shortcut_rules,
    yes_no,
)
from routeformer.compare.stats import beats_floor, best_floor, delta_separated, paired_delta, pareto_front
from routeformer.runner.report import markdown_table, mean_sd, scatter_plot
from routeformer.runner.setups import TaskSetup
from routeformer.train.on_task import ModelSpec

STRETCH_MARGIN = 0.02  # the stretch bar: within 0.02 accuracy / bits per char of full ...
STRETCH_SPEEDUP = 2.0  # ... at >= 2x less training time per step at that length


def staged_intro(spec: ModelSpec, repeats: int) -> str:
    """What every staged task's numbers mean (the report's opening paragraph)."""
    return (
        f"One backbone for every mechanism ({spec.depth} layers, D={spec.dim}, {spec.heads} heads, MLP ratio "
        f"{spec.mlp_ratio}, {spec.positions} positions); per seed every mechanism sees the same batches. "
        "Training follows a curriculum (stages below: shorter, easier versions of the task first; "
        "AdamW's warm-up and cosine decay restart per stage); mechanism options are those of the "
        "training length T throughout (below T = 512: local window T/4, top-k T/8 keys, MiTA T/8 "
        "landmarks of T/8 keys in causal blocks of T/8, Meta-Attention's local expert T/4; from T = 512 "
        "routed budgets in keys, listed per task; meta-token density 0.1 on the LM). Quality on the test "
        "split (the setups were chosen on "
        "validation), mean ± sd over seeds; Δ vs full: mean ± sd over seeds of the per-seed difference. "
        "2T and 4T: the trained model evaluated forward only on longer test sequences. Costs: medians of "
        f"{repeats} rounds alternating the mechanism with `full` (one thread), time ratio = the "
        "median of the per-round ratios (< 1: cheaper than full); FLOPs: attention FLOPs executed per "
        "sequence; peak MiB: extra memory of one training step at T. A difference counts only beyond 3 sd.")


def flat_records(task: str, by_mechanism: dict[str, list[dict[str, Any]]], costs: dict, floors: dict
                 ) -> list[dict]:
    """One record per (evaluated length, mechanism, seed) of `task`, the fields result.json promises."""
    rows = []
    for mechanism, records in by_mechanism.items():
        cost = costs[mechanism]
        for record in records:
            train_len = int(record["task_options"]["seq_len"])
            for length, test in record["tests"].items():
                floor = floors[int(length)]
                inference = cost["inference"][length]
                rows.append(
                    {
                        "task": task,
                        "seq_len": int(length),
                        "train_seq_len": train_len,
                        "mechanism": mechanism,
                        "seed": record["seed"],
                        "quality": {
                            "name": floor["metric"],
                            "higher_is_better": floor["higher_is_better"],
                            "value": test[floor["metric"]],
                        },
                        "params": record["parameters"],
                        "train_ms_per_step": cost["train_ms_per_step"],
                        "infer_ms_per_seq": inference["infer_ms_per_seq"],
                        "attention_flops": test["attention_flops_per_token"] * int(length),
                        "peak_mib": cost["peak_mib"],
                        "train_seconds": record["train_seconds"],
                    }
                )
    return rows


def staged_task_sections(
    out: Path, task: str, setup: TaskSetup, by_mechanism: dict[str, list[dict]], costs: dict[str, dict],
    floors: dict[int, dict],
) -> tuple[list[str], dict[str, dict]]:
    """A staged task's report sections and its result.json summary (rows by length, by mechanism);
    writes `pareto_{task}.png`. `costs` by mechanism; `floors` by length."""
    stages = "; ".join(
        f"{s.schedule.steps} steps of batch {s.schedule.batch_size} on "
        + (", ".join(f"{k}={v}" for k, v in s.options.items()) or "the task itself")
        + f" (lr {s.schedule.lr:g}, {s.schedule.warmup_steps} "
        "warm-up)"
        for s in setup.stages
    )
    sections = [f"## {task} (trained at T = {setup.seq_len})", f"Stages: {stages}.",
                "Layer options at T (budgets in keys from T = 512: compare/budgets.py; the task's "
                "recipe on top): " + "; ".join(
                    f"{m}: " + (", ".join(f"{k}={v}" for k, v in records[0]["options"].items())
                                or "defaults")
                    for m, records in by_mechanism.items()) + "."]
    forced = {m: costs[m].get("routing_shares") for m in by_mechanism if m in costs}
    sections += [
        f"Costs of {m} timed as it trains at T: hard-routed at the trained runs' mean share of tokens "
        "per expert (" + " / ".join(f"{share:.3f}" for share in shares) + "; full / linear / local), "
        "past its warm-up."
        for m, shares in forced.items() if shares]
    summary, details = {}, []
    for multiple, length in zip((1, *setup.eval_multiples), map(str, setup.lengths), strict=True):
        rows, table = length_rows(by_mechanism, costs, floors[int(length)], length)
        summary[length] = rows
        details += length_section(task, length, multiple, table, floors[int(length)])
        details += position_section(by_mechanism, length, floors[int(length)])
        details += copy_section(by_mechanism, length, floors[int(length)])
    floor = floors[setup.seq_len]
    sections += pays_section(task, summary, floor) + details + training_section(by_mechanism, setup, costs)
    points = {m: (r["train_ms_per_step"], r["quality_mean"]) for m, r in summary[str(setup.seq_len)].items()}
    scatter_plot(
        out / f"pareto_{task}.png",
        points,
        pareto_front(points, floor["higher_is_better"]),
        xlabel="training ms per step at T (one thread)",
        ylabel=floor["metric"],
        title=f"{task} at T={setup.seq_len}: quality (mean ± sd) vs step time",
        errors={m: r["quality_sd"] for m, r in summary[str(setup.seq_len)].items()},
        reference=("best shortcut / chance", best_floor(floor)),
        samples={m: [rec["tests"][str(setup.seq_len)][floor["metric"]] for rec in records]
                 for m, records in by_mechanism.items()},
        limits=(0.0, 1.0) if floor["metric"] == "accuracy" else (0.0, float("inf")),
    )
    sections.append(
        f"Plot: `pareto_{task}.png` (quality at T against training time per step; filled: "
        "the Pareto front)."
    )
    return sections, summary


def _mean_flops(records: list[dict], length: str) -> float:
    """Attention FLOPs per sequence at `length`, mean over the records."""
    return statistics.fmean(r["tests"][length]["attention_flops_per_token"] for r in records) * int(length)


def length_rows(by_mechanism: dict, costs: dict, floor: dict, length: str) -> tuple[dict, list]:
    """Per mechanism at `length`: its result.json row (quality mean ± sd, paired Δ vs full, whether
    it beats the floor, params, cost ratios, FLOPs, peak memory) and its row of the length table."""
    metric, higher = floor["metric"], floor["higher_is_better"]
    baseline = baseline_name()  # full: the deltas and ratios are against it
    full = by_mechanism.get(baseline, [])
    full_values = {r["seed"]: r["tests"][length][metric] for r in full}
    best = best_floor(floor)
    rows, table = {}, []
    for mechanism, records in by_mechanism.items():
        values = [r["tests"][length][metric] for r in records]
        mean, sd = mean_sd(values)
        delta = (paired_delta([(r["seed"], r["tests"][length][metric]) for r in records], full_values)
                 if full and mechanism != baseline else (0.0, 0.0))
        cost = costs[mechanism]
        inference = cost["inference"][length]
        flops = _mean_flops(records, length)
        full_flops = _mean_flops(full, length) if full else None
        beats = beats_floor(values, best, higher)
        row = {
            "quality_mean": mean,
            "quality_sd": sd,
            "qualities": values,
            "delta_mean": delta[0],
            "delta_sd": delta[1],
            "delta_separated": mechanism != baseline and delta_separated(*delta, len(values)),
            "beats_floor": beats,
            "params": records[0]["parameters"],
            "train_ms_per_step": cost["train_ms_per_step"],
            "train_time_vs_full": cost["train_time_vs_full"],
            "infer_ms_per_seq": inference["infer_ms_per_seq"],
            "infer_time_vs_full": inference["infer_time_vs_full"],
            "attention_flops": flops,
            "flops_vs_full": flops / full_flops if full_flops else None,
            "peak_mib": cost["peak_mib"],
        }
        rows[mechanism] = row
        table.append(
            [
                mechanism,
                row["params"],
                mean_sd_cell(mean, sd),
                yes_no(beats),
                NO_DELTA if mechanism == baseline else delta_cell(*delta, row["delta_separated"], digits=4),
                ratio_cell(row["train_time_vs_full"]),
                ratio_cell(row["infer_time_vs_full"]),
                ratio_cell(row["flops_vs_full"]),
                f"{row['train_ms_per_step']:.0f}",
                f"{row['infer_ms_per_seq']:.1f}",
                optional_cell(row["peak_mib"], ".0f"),
            ]
        )
    return rows, table


def length_section(task: str, length: str, multiple: int, table: list, floor: dict) -> list[str]:
    """The heading, floor and table (`length_rows`) of one evaluated length (`multiple` x T)."""
    metric = floor["metric"]
    where = "the training length" if multiple == 1 else f"{multiple}x the training length, forward only"
    return [
        f"### {task} at T = {length} ({where})",
        f"Floor: chance {floor['chance']:.4f}; shortcut rules on the test split: {shortcut_rules(floor)}.",
        markdown_table(
            [
                "mechanism",
                "params",
                f"{metric} (mean ± sd)",
                "beats floor by > 3 sd",
                "Δ vs full (± sd; * > 3 sd)",
                "train time / full (at T)",
                "inference time / full",
                "attention FLOPs / full",
                "train ms/step (at T)",
                "inference ms/seq",
                "peak MiB (train)",
            ],
            table,
        ),
    ]


def position_section(by_mechanism: dict, length: str, floor: dict) -> list[str]:
    """LM tasks: bits per character per position bucket of the window (mean ± sd over seeds), beside
    the n-gram floors of the same buckets on the same test windows: a mechanism that reads only
    nearby text loses in the late buckets. With full and another mechanism, a second table of the
    paired Δ vs full per bucket (— where no seed pairs with full). [] when a record lacks buckets."""
    per_seed = {m: [r["tests"][length].get("bits_per_char_by_position") for r in records]
                for m, records in by_mechanism.items()}
    if not per_seed or any(b is None for values in per_seed.values() for b in values):
        return []
    buckets = list(next(iter(per_seed.values()))[0])
    seeds = {m: [r["seed"] for r in records] for m, records in by_mechanism.items()}
    cells = bucket_cells(per_seed, seeds, buckets)
    table = [[m, *[value for value, _ in row]] for m, row in cells.items()]
    table += floor_rows(floor.get("position_baselines", {}), buckets)
    counts = next(iter(by_mechanism.values()))[0]["tests"][length].get("tokens_by_position", {})
    lines = [
        f"Bits per character by position in the window at T = {length} (mean ± sd over seeds; with "
        "documents=start a position is the character's place in its file; predictions per bucket: "
        + ", ".join(f"{b}: {n}" for b, n in counts.items()) + ").",
        markdown_table(["mechanism", *[f"{b}" for b in buckets]], table),
    ]
    if baseline_name() not in per_seed or len(per_seed) < 2:
        return lines
    deltas = [[m, *[delta for _, delta in row]] for m, row in cells.items() if m != baseline_name()]
    return lines + [
        f"Δ vs full by position at T = {length} (the mechanism's bits/char minus full's, mean ± sd over "
        "seeds of the per-seed difference; > 0: full is better there; * beyond 3 sd).",
        markdown_table(["mechanism", *buckets], deltas),
    ]


def copy_section(by_mechanism: dict, length: str, floor: dict) -> list[str]:
    """LM tasks with documents="start": bits per character on the copy-predictable characters (the
    next character follows an earlier occurrence of its preceding context more than the copy
    distance back, with no nearer one: tasks/lm.py), per context length, beside full and the n-gram
    floors on the same characters. [] when a record has none."""
    per_seed = {m: [r["tests"][length].get("bits_per_char_copy_predictable") for r in records]
                for m, records in by_mechanism.items()}
    if not per_seed or any(not b for values in per_seed.values() for b in values):
        return []
    contexts = list(next(iter(per_seed.values()))[0])
    seeds = {m: [r["seed"] for r in records] for m, records in by_mechanism.items()}
    table = [[m, *[cell for pair in row for cell in pair]]
             for m, row in bucket_cells(per_seed, seeds, contexts).items()]
    bits_floors = {name: by_context for name, by_context in
                   floor.get("copy_predictable_baselines", {}).items()
                   if name.endswith("(bits/char)")}
    table += floor_rows(bits_floors, contexts, blank_after=True)
    fraction = next(iter(by_mechanism.values()))[0]["tests"][length].get("copy_predictable_fraction", {})
    return [
        f"Bits per character on the copy-predictable characters at T = {length}: the next character "
        "is the one that followed an earlier occurrence of its preceding c characters, more than 64 "
        "characters back with no nearer occurrence (a copy oracle is right on every one; share of the "
        "scored characters: " + ", ".join(f"c = {c}: {v:.3f}" for c, v in fraction.items())
        + "). Mean ± sd over seeds; Δ vs full as above.",
        markdown_table(["mechanism", *[h for c in contexts for h in (f"c = {c}", f"Δ vs full (c = {c})")]],
                       table),
    ]


def _mean_of(entries: list[dict], field: str, key: str) -> str:
    return f"{statistics.fmean(entry[field][key] for entry in entries):.3f}" if entries else "-"


def training_section(by_mechanism: dict, setup: TaskSetup, costs: dict | None = None) -> list[str]:
    """LM tasks: validation along the stage at T — bits/char in the last position bucket and on the
    copy-predictable characters (shortest context), mean over seeds, per mechanism: whether a gap
    between mechanisms opens or closes with training. With `costs`, each mechanism's training
    seconds into the stage at T (its steps x its measured ms per training step at T): the same
    rows read at equal time rather than equal tokens. [] without such validation entries."""
    last = len(setup.stages) - 1
    series: dict[str, dict[int, list[dict]]] = {}
    for mechanism, records in by_mechanism.items():
        for record in records:
            for entry in record.get("validation", []):
                if entry.get("stage") == last and "bits_per_char_by_position" in entry:
                    series.setdefault(mechanism, {}).setdefault(entry["step"], []).append(entry)
    if not series:
        return []
    steps = sorted({step for by_step in series.values() for step in by_step})
    first = next(iter(series.values()))[steps[0]][0]
    bucket = list(first["bits_per_char_by_position"])[-1]
    copy = list(first.get("bits_per_char_copy_predictable", {}))[:1]
    done = sum(stage.schedule.steps * stage.schedule.batch_size
               * int(stage.options.get("seq_len", setup.seq_len)) for stage in setup.stages[:last])
    tokens_per_step = setup.schedule.batch_size * setup.seq_len
    header, table = ["step at T", "training tokens (M)"], []
    step_ms = {m: (costs or {}).get(m, {}).get("train_ms_per_step") for m in series}
    for mechanism in series:
        if step_ms[mechanism]:
            header.append(f"{mechanism}: s at T")
        header.append(f"{mechanism}: {bucket}")
        if copy:
            header.append(f"{mechanism}: copy-predictable (c = {copy[0]})")
    for step in steps:
        row = [str(step), f"{(done + step * tokens_per_step) / 1e6:.1f}"]
        for mechanism, by_step in series.items():
            entries = by_step.get(step, [])
            if step_ms[mechanism]:
                row.append(f"{step * step_ms[mechanism] / 1e3:.0f}")
            row.append(_mean_of(entries, "bits_per_char_by_position", bucket))
            if copy:
                row.append(_mean_of(entries, "bits_per_char_copy_predictable", copy[0]))
        table.append(row)
    return [
        f"Validation along the stage at T = {setup.seq_len} (documents' starts of the validation split; "
        f"bits/char in the {bucket} bucket and on the copy-predictable characters, mean over seeds; "
        "s at T: the mechanism's steps at T times its training ms per step at T from the cost table, "
        "so rows of equal s compare equal training time at T).",
        markdown_table(header, table),
    ]


def pays_section(task: str, by_length: dict[str, dict], floor: dict[str, Any]) -> list[str]:
    """The "where routing pays" table: per mechanism, Δ vs full at every length beside the time
    ratios measured in the same run, and which mechanisms meet the stretch bar at T (within
    STRETCH_MARGIN of full at STRETCH_SPEEDUP x less training time per step)."""
    lengths = list(by_length)
    train_length = lengths[0]
    higher = floor["higher_is_better"]
    baseline = baseline_name()
    table = []
    for mechanism, row in by_length[train_length].items():
        cells = [mechanism]
        for length in lengths:
            r = by_length[length][mechanism]
            cells.append(NO_DELTA if mechanism == baseline
                         else delta_cell(r["delta_mean"], r["delta_sd"], r["delta_separated"]))
        cells.append(ratio_cell(row["train_time_vs_full"]))
        cells += [ratio_cell(by_length[length][mechanism]["infer_time_vs_full"]) for length in lengths]
        table.append(cells)
    meets = [
        m
        for m, r in by_length[train_length].items()
        if m != baseline
        and (r["delta_mean"] >= -STRETCH_MARGIN if higher else r["delta_mean"] <= STRETCH_MARGIN)
        and r["train_time_vs_full"] <= 1 / STRETCH_SPEEDUP
    ]
    direction = "higher" if higher else "lower"
    return [
        f"### Where routing pays ({task}): quality Δ vs full and time ratios, same run",
        f"Δ: {floor['metric']} minus full's ({direction} is better), mean ± sd over seeds of the per-seed "
        "difference; * beyond 3 sd. Time ratios: the mechanism's time / full's in the same rounds (< 1: "
        "cheaper).",
        markdown_table(
            [
                "mechanism",
                *[f"Δ at T={length}" for length in lengths],
                f"train time / full (T={train_length})",
                *[f"inference time / full (T={length})" for length in lengths],
            ],
            table,
        ),
        f"Stretch bar (within {STRETCH_MARGIN} of full at ≥ {STRETCH_SPEEDUP:g}x less training time per "
        f"step, at T={train_length}): "
        + (", ".join(meets) + (" meets it." if len(meets) == 1 else " meet it.") if meets
           else "no mechanism meets it."),
    ]
