"""The compare report's shared pieces: one module writes the one-stage and the staged sections with
the same cells, and the statistics behind them (best floor, beats floor, paired Δ) are stats.py's."""

import math
from dataclasses import replace

import pytest

from routeformer.compare.budgets import LONG, QUICK, curriculum_setup
from routeformer.compare.report import one_stage, staged, tables, write_compare_report
from routeformer.compare.stats import (
    beats_floor,
    best_floor,
    delta_separated,
    paired_delta,
    paired_differences,
)
from routeformer.runner.setups import Stage
from routeformer.train.schedule import Schedule

TOY_SCHEDULE = Schedule(steps=2, batch_size=4, lr=1e-3, warmup_steps=1)


def test_one_stage_and_staged_sections_share_the_table_module():
    for module in (one_stage, staged):
        assert module.mean_sd_cell is tables.mean_sd_cell
        assert module.ratio_cell is tables.ratio_cell
        assert module.shortcut_rules is tables.shortcut_rules
        assert module.best_floor is best_floor and module.beats_floor is beats_floor


def test_cells():
    assert tables.mean_sd_cell(0.5, 0.25) == "0.5000 ± 0.2500"
    assert tables.values_cell([1.0, 3.0]) == "2.000 ± 1.414"
    assert tables.values_cell([2.0]) == "2.000 ± 0.000"
    assert tables.values_cell([]) == tables.NO_DELTA
    assert tables.delta_cell(-0.5, 0.1, True, digits=4) == "-0.5000 ± 0.1000 *"
    assert tables.deltas_cell([0.5, 0.5]) == "+0.500 ± 0.000 *"
    assert tables.deltas_cell([0.5]) == "+0.500 ± 0.000"  # one seed: never marked
    assert tables.deltas_cell([]) == tables.NO_DELTA
    assert (tables.ratio_cell(None), tables.ratio_cell(0.456), tables.ratio_cell(0.5029, ".4g")) == (
        "-", "0.46", "0.5029")
    assert (tables.optional_cell(None), tables.optional_cell(46.44), tables.optional_cell(106.8, ".0f")) == (
        "-", 46.44, "107")
    assert tables.shortcut_rules({"baselines": {"a": 0.25, "b: c": 1 / 3}}) == "a: 0.2500; b: c: 0.3333"
    assert tables.floor_rows({"bigram": {"8": 3.0, "16": 2.9}}, ["8", "16"], blank_after=True) == [
        ["floor: bigram", "3.000", "", "2.900", ""]]


def test_bucket_cells_pair_by_seed_and_mark_no_pair():
    per_seed = {"full": [{"a": 1.0}, {"a": 2.0}], "local": [{"a": 2.5}, {"a": 1.5}],
                "topk": [{"a": 9.0}]}
    seeds = {"full": [0, 1], "local": [1, 0], "topk": [7]}
    cells = tables.bucket_cells(per_seed, seeds, ["a"])
    assert cells["full"] == [("1.500 ± 0.707", "—")]
    assert cells["local"] == [("2.000 ± 0.707", "+0.500 ± 0.000 *")]
    assert cells["topk"] == [("9.000 ± 0.000", "—")]  # no seed shared with full
    assert tables.bucket_cells({"local": [{"a": 1.0}]}, {"local": [0]}, ["a"]) == {
        "local": [("1.000 ± 0.000", "—")]}


def test_floor_statistics():
    floor = {"chance": 0.125, "baselines": {"first": 0.25, "last": 0.2}, "higher_is_better": True}
    assert best_floor(floor) == 0.25
    assert best_floor({**floor, "higher_is_better": False}) == 0.125
    with pytest.raises(ValueError, match="floor must hold"):
        best_floor({"chance": 0.1})
    assert beats_floor([0.9, 0.91], 0.25, True) and not beats_floor([0.9], 0.25, True)
    assert not beats_floor([], 0.25, True)
    assert not beats_floor([0.1, 0.9], 0.25, True)  # too spread to be beyond 3 sd
    assert beats_floor([2.0, 2.01], 3.3, False) and not beats_floor([2.0, 2.01], 3.3, True)


def test_paired_statistics():
    assert paired_differences([(1, 0.5), (0, 0.2), (5, 9.0)], {0: 0.1, 1: 0.3}) == pytest.approx([0.2, 0.1])
    mean, sd = paired_delta([(5, 1.0)], {0: 0.1})
    assert math.isnan(mean) and math.isnan(sd)
    assert paired_delta([(0, 0.4)], {0: 0.1}) == (pytest.approx(0.3), 0.0)
    assert delta_separated(0.5, 0.1, 2) and not delta_separated(0.5, 0.1, 1)
    assert not delta_separated(0.2, 0.1, 3) and not delta_separated(float("nan"), float("nan"), 3)


def _staged_runs(seeds_of):
    def record(seed, value, late):
        return {"seed": seed, "parameters": 10, "train_seconds": 1.0, "options": {},
                "task_options": {"seq_len": 32},
                "tests": {"32": {"bits_per_char": value, "attention_flops_per_token": 4.0,
                                 "bits_per_char_by_position": {"0-16": 2.0, "16-32": late},
                                 "tokens_by_position": {"0-16": 16, "16-32": 16}}}}

    return {m: [record(seed, 2.0 + 0.1 * i + 0.01 * seed, 1.5 + 0.1 * i) for seed in seeds]
            for i, (m, seeds) in enumerate(seeds_of.items())}


def test_a_staged_report_without_a_seed_paired_with_full_writes_dashes(tmp_path):
    """A mechanism none of whose seeds full ran: Δ cells read — (position table) and nan (length table)."""
    setup = curriculum_setup({"seq_len": 32}, (Stage({"seq_len": 16}, TOY_SCHEDULE), Stage({}, TOY_SCHEDULE)),
                             test_tokens=256, eval_multiples=())
    runs = _staged_runs({"full": [0, 1], "local": [0, 1], "topk": [5, 6]})
    cost = {"train_ms_per_step": 10.0, "train_time_vs_full": 0.5, "peak_mib": None,
            "inference": {"32": {"infer_ms_per_seq": 1.0, "infer_time_vs_full": 0.5}}}
    floor = {"metric": "bits_per_char", "higher_is_better": False, "chance": 5.0,
             "baselines": {"bigram": 3.0}}
    report = write_compare_report(tmp_path, {"lm": runs}, {"lm": {32: floor}},
                                  {"lm": dict.fromkeys(runs, cost)}, [], replace(LONG, tasks={"lm": setup}),
                                  "routeformer compare --long",
                                  elapsed=1.0, workers=1)
    text = report.read_text()
    assert "| topk | — | — |" in text and "| topk | 10 | 2.2550 ± 0.0071 | yes | +nan ± nan |" in text


def test_a_setup_given_for_a_task_the_budget_lacks_is_used(tmp_path):
    setup = QUICK.tasks["mqar"]
    runs = {"full": [{"seed": 0, "quality": 0.5, "parameters": 3, "attention_flops_per_token": 2.0,
                      "train_seconds": 1.0}]}
    floor = {"task": "t", "metric": "accuracy", "higher_is_better": True, "chance": 0.1,
             "baselines": {"r": 0.2}}
    report = write_compare_report(tmp_path, {"elsewhere": runs}, {"elsewhere": {0: floor}}, {}, [], QUICK,
                                  "routeformer compare", elapsed=1.0, workers=1, setups={"elsewhere": setup})
    assert "## elsewhere" in report.read_text()
