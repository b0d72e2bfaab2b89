"""meta-attention-matched: the variants change one thing each, full-matched matches meta's
parameter count, the criterion and paired differences are computed as stated, and a toy run writes
its report end to end."""

import json
import math
from dataclasses import replace

import pytest

from routeformer.experiments.meta_attention_matched import (
    FULL_BUDGET,
    QUICK_BUDGET,
    run_matched,
    variants,
)
from routeformer.experiments.meta_attention_report import criterion, summarise
from routeformer.experiments.registry import list_experiments
from routeformer.models.config import ModelConfig
from routeformer.models.heads import TokenPredictor
from routeformer.train.on_task import parameter_count


def test_each_ablation_changes_one_option_of_the_bayesian_model():
    table = variants(FULL_BUDGET)
    bayesian = table["bayesian"][1]
    for name, changed in (("kl-free", {"elbo_weight"}), ("prior-free", {"prior"})):
        options = table[name][1]
        assert {k for k in {*options, *bayesian} if options.get(k) != bayesian.get(k)} == changed, name
    assert table["non-bayesian"][1] == {**bayesian, "prior": "none", "elbo_weight": 0.0}
    assert {table[n][2] for n in ("bayesian", "kl-free", "prior-free", "non-bayesian", "full")} == {
        FULL_BUDGET.spec}, "only full-matched changes the backbone"


def test_full_matched_is_within_one_percent_of_meta_parameters():
    """The full budget's backbone at vocabulary 105 (the pydoc corpus); the count does not depend on T."""
    counts = {}
    for name in ("bayesian", "full-matched", "full"):
        mechanism, options, spec = variants(FULL_BUDGET)[name]
        config = ModelConfig(vocab_size=105, dim=spec.dim, depth=spec.depth, heads=spec.heads,
                             mlp_ratio=spec.mlp_ratio, attention=mechanism,
                             attention_options={mechanism: options} if options else {},
                             positions=spec.positions, max_seq_len=128, tie_embeddings=False)
        counts[name] = parameter_count(TokenPredictor(config))
    assert abs(counts["full-matched"] / counts["bayesian"] - 1) < 0.01
    assert counts["full"] < 0.6 * counts["bayesian"], "the unmatched full is far smaller"


def _fake_run(seed, loss, flops, hard_loss=None, hard_flops=None):
    soft = {"loss": loss, "attention_flops_per_token": flops,
            "routing": {"routing_entropy_pct": 50.0, "projected_cost": 0.3, "kl": 0.1, "weight_full": 0.2,
                        "rows_full": 1.0, "rows_linear": 1.0, "rows_local": 1.0}}
    modes = {"soft": soft}
    if hard_loss is not None:
        shares = {"rows_full": 0.1, "rows_linear": 0.6, "rows_local": 0.3}
        modes["hard"] = {"loss": hard_loss, "attention_flops_per_token": hard_flops,
                         "routing": {**soft["routing"], **shares}}
    return {"seed": seed, "quality": loss / math.log(2), "parameters": 10, "lengths": {"8": modes}}


def test_criterion_and_paired_gaps_are_taken_seed_by_seed():
    runs = {
        "full-matched": [_fake_run(0, 2.0, 100.0), _fake_run(1, 1.0, 100.0)],
        "bayesian": [_fake_run(1, 1.2, 300.0, hard_loss=1.4, hard_flops=60.0),  # order differs from full's
                     _fake_run(0, 2.5, 300.0, hard_loss=2.6, hard_flops=80.0)],
    }
    result = criterion(runs, "bayesian", 8)
    assert result["flops_saving"] == pytest.approx([0.4, 0.2])
    assert result["loss_gap_nats"] == pytest.approx([0.4, 0.6])
    assert (result["seeds_met"], result["seeds"]) == (1, 2)  # seed 1: 40 % saved, 0.4 nats; seed 0 fails both
    summary = summarise(runs, [8])["variants"]["bayesian"]
    assert summary["gap_vs_full-matched@8"] == pytest.approx([0.2, 0.5])
    assert summary["hard_shares@train"] == [[0.1, 0.6, 0.3]] * 2


def test_toy_run_writes_report_and_result(tmp_path):
    assert "meta-attention-matched" in list_experiments()
    toy = replace(QUICK_BUDGET, setup=replace(QUICK_BUDGET.setup, options={"corpus": "pydoc", "seq_len": 16},
                                              schedule=replace(QUICK_BUDGET.setup.schedule, steps=1),
                                              validation_sequences=2, test_sequences=2),
                  spec=replace(QUICK_BUDGET.spec, dim=16), test_characters=128, routing_sequences=2)
    report = run_matched(tmp_path, toy, "toy")
    text = report.read_text()
    for heading in ("## Parameters", "Table 3", "## Length extrapolation", "falsifiability criterion at the "
                    "training length (T = 16)", "At 32 (extrapolation", "At 64 (extrapolation", "Table 4"):
        assert heading in text, heading
    assert "0.613× (−39%)" in text and "~0.36× (−64%)" in text, "the paper's Table 4 as printed"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["lengths"] == [16, 32, 64]
    assert set(result["summary"]["variants"]) == set(variants(toy))
    bayesian = result["runs"]["bayesian"][0]
    assert bayesian["lengths"]["16"]["hard"]["routing"]["hard_fraction"] == 1.0  # η = 0: every token hard
    assert "hard" not in result["runs"]["full"][0]["lengths"]["16"]


def test_table3_runs_its_subset_in_two_processes_and_caches_each_run(tmp_path):
    """meta-attention-table3: the preprint's Table 3 setting, three variants, two worker processes;
    a second call reads every run back instead of training it again."""
    from routeformer.experiments.meta_attention_matched import TABLE3_BUDGET, TABLE3_QUICK

    assert "meta-attention-table3" in list_experiments()
    assert set(variants(TABLE3_BUDGET)) == {"bayesian", "non-bayesian", "full-matched"}
    setup = TABLE3_BUDGET.setup
    assert (setup.options["seq_len"], setup.schedule.steps, setup.schedule.batch_size, TABLE3_BUDGET.spec.dim,
            TABLE3_BUDGET.spec.depth, setup.options["corpus"]) == (64, 2000, 32, 128, 2, "wikitext2")
    toy = replace(TABLE3_QUICK, setup=replace(TABLE3_QUICK.setup, options={"corpus": "pydoc", "seq_len": 16},
                                              schedule=replace(TABLE3_QUICK.setup.schedule, steps=1),
                                              validation_sequences=2, test_sequences=2),
                  spec=replace(TABLE3_QUICK.spec, dim=16), test_characters=128, routing_sequences=2)
    run_matched(tmp_path, toy, "toy")
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result["runs"]) == {"bayesian", "non-bayesian", "full-matched"}
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")}
    assert len(stamps) == 3
    run_matched(tmp_path, toy, "toy")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")} == stamps
