"""`routeformer compare --long` at toy size: stages, evaluation at 1x/2x/4x, paired Δ, the cost
ratios, result.json's per-(task, length, mechanism, seed) records, resume, the CLI's errors."""

import json
from dataclasses import replace

import pytest

from routeformer.cli import main
from routeformer.compare import budgets, costs
from routeformer.compare.budgets import LONG, check_long_selection, curriculum_setup
from routeformer.compare.report.staged import copy_section, position_section, training_section
from routeformer.compare.run import compare_jobs, run_compare
from routeformer.compare.stats import paired_delta
from routeformer.runner import jobs
from routeformer.runner.jobs import Job, train_job
from routeformer.runner.setups import Stage
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule

RECORD_FIELDS = {
    "task",
    "seq_len",
    "train_seq_len",
    "mechanism",
    "seed",
    "quality",
    "params",
    "train_ms_per_step",
    "infer_ms_per_seq",
    "attention_flops",
    "peak_mib",
}
TOY_SCHEDULE = Schedule(steps=2, batch_size=4, lr=1e-3, warmup_steps=1)


def toy_budget():
    toy = {"evals": 1, "validation_sequences": 8, "test_tokens": 256, "cost_batch": 2}
    return replace(
        LONG,
        tasks={
            "mqar": curriculum_setup(
                {"seq_len": 32, "pairs": 4, "vocab_size": 16},
                (Stage({"seq_len": 16, "pairs": 2}, TOY_SCHEDULE), Stage({}, TOY_SCHEDULE)),
                **toy,
            ),
            "lm": curriculum_setup({"seq_len": 32}, (Stage({}, TOY_SCHEDULE),), **toy),
        },
        spec=ModelSpec(dim=16, depth=1, heads=2, positions="rotary"),
        seeds=2,
        repeats=1,
    )


def run_toy(out):
    return run_compare(out, mechanisms=["full", "local", "meta_tokens"], tasks=["mqar", "lm"],
                       budget=toy_budget(), seeds=2, workers=1, corpus="pydoc")


def test_toy_long_compare_reports_every_length_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "long"
    report = run_toy(out)
    result = json.loads((out / "result.json").read_text())
    records = result["records"]
    assert all(RECORD_FIELDS <= set(record) for record in records)
    # mqar: full, local (meta_tokens is LM-only); lm: all three; 2 seeds; lengths 32, 64, 128
    assert len(records) == (2 + 3) * 2 * 3
    assert {r["seq_len"] for r in records} == {32, 64, 128} and {r["train_seq_len"] for r in records} == {32}
    mqar = result["tasks"]["mqar"]
    assert set(mqar) == {"32", "64", "128"} and set(mqar["32"]) == {"full", "local"}
    assert mqar["32"]["full"]["train_time_vs_full"] == pytest.approx(1.0)
    assert mqar["32"]["full"]["delta_mean"] == 0.0
    for length, rows in mqar.items():  # the paired Δ is the mean of per-seed differences
        full = {
            r["seed"]: r["quality"]["value"]
            for r in records
            if r["task"] == "mqar" and r["mechanism"] == "full" and r["seq_len"] == int(length)
        }
        local = [
            r["quality"]["value"] - full[r["seed"]]
            for r in records
            if r["task"] == "mqar" and r["mechanism"] == "local" and r["seq_len"] == int(length)
        ]
        assert rows["local"]["delta_mean"] == pytest.approx(sum(local) / 2)
        assert rows["local"]["infer_time_vs_full"] > 0 and rows["local"]["attention_flops"] > 0
    text = report.read_text()
    for heading in (
        "## mqar (trained at T = 32)",
        "### mqar at T = 128 (4x",
        "## lm",
        "Stages: 2 steps of batch 4 on seq_len=16, pairs=2",
        "Δ vs full",
        "train time / full",
        "shortcut rules",
        "Bits per character by position in the window at T = 32",
        "| floor: bigram (bits/char) |",
        "Layer options at T",
    ):
        assert heading in text
    assert (out / "pareto_mqar.png").exists() or "matplotlib" not in str(report)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(jobs, "train_job", must_not_run)
    monkeypatch.setattr(costs, "measure_beside_full", must_not_run)
    run_toy(out)
    assert json.loads((out / "result.json").read_text())["records"] == records


def test_stages_train_one_model_on_each_stage_task():
    setup = toy_budget().tasks["mqar"]
    record = train_job(
        Job(
            "k",
            "mqar",
            setup.options,
            "full",
            {},
            0,
            setup,
            ModelSpec(dim=16, depth=1, heads=2, positions="rotary"),
        )
    )
    assert [v["task"] for v in record["validation"]] == [
        "mqar(seq_len=16, pairs=2, vocab_size=16, spacing=uniform)",
        "mqar(seq_len=32, pairs=4, vocab_size=16, spacing=uniform)",
    ]
    assert set(record["tests"]) == {"32", "64", "128"}
    assert record["quality"] == record["tests"]["32"]["accuracy"]


def test_a_setup_named_apart_from_its_task_builds_that_task():
    """`mqar_512` builds `mqar`: the setup's key names the jobs, `task` the registered task."""
    setup = replace(toy_budget().tasks["mqar"], task="mqar")

    def jobs_of(setup):
        return compare_jobs(["recall_short"], ["full"], replace(toy_budget(), tasks={"recall_short": setup},
                                                               seeds=1), "pydoc")

    assert [job.key for job in jobs_of(setup)] == ["long-recall_short-full-seed0"]
    record = train_job(jobs_of(setup)[0])
    assert (record["setup"], record["task_name"]) == ("recall_short", "mqar")
    assert record["validation"][-1]["task"].startswith("mqar(seq_len=32")
    with pytest.raises(ValueError, match="unknown task"):
        train_job(jobs_of(replace(setup, task=""))[0])


def test_one_stage_trains_as_the_plain_compare_path():
    """A staged setup whose only stage is the task itself trains and tests the same model as compare
    --quick's one-stage setup: the same validation history, the same test at T, bit for bit."""
    plain = replace(toy_budget().tasks["mqar"], curriculum=(), eval_multiples=())
    staged = replace(plain, eval_multiples=(2,))
    assert not plain.staged and staged.staged and staged.stages == plain.stages

    def record(setup):
        return train_job(Job("k", "mqar", setup.options, "local", {"window": 8}, 1, setup, toy_budget().spec))

    one, stages = record(plain), record(staged)
    assert [{k: v for k, v in e.items() if k not in ("stage", "task")} for e in stages["validation"]] \
        == one["validation"]
    assert {k: v for k, v in stages["tests"]["32"].items() if k != "seconds"} == one["test"]
    assert (stages["quality"], stages["parameters"], stages["stages"]) == (
        one["quality"], one["parameters"], [{"options": {}, "schedule": one["train"]["schedule"]}])
    assert set(stages["tests"]) == {"32", "64"}


def test_paired_delta_pairs_by_seed():
    assert paired_delta([(1, 0.5), (0, 0.2)], {0: 0.1, 1: 0.3}) == (
        pytest.approx(0.15),
        pytest.approx(0.0707106781),
    )


def test_long_selection_and_cli_errors(tmp_path, capsys):
    assert check_long_selection(["local", "full", "local"], None) == (
        ["full", "local"], list(budgets.default_long_tasks()))
    with pytest.raises(ValueError, match="tasks: --long has"):
        check_long_selection(None, ["listops"])
    assert main(["compare", "--long", "--quick", "--out", str(tmp_path)]) == 2
    assert "--quick and --long" in capsys.readouterr().err
    assert main(["compare", "--long", "--mechanisms", "nope", "--out", str(tmp_path)]) == 2
    assert "mechanisms: unknown ['nope']" in capsys.readouterr().err


def test_the_default_long_tasks_read_the_python_source_only_where_it_is_on_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ or ../shared/data here
    monkeypatch.setenv("ROUTEFORMER_DATA_DIR", str(tmp_path / "nowhere"))
    assert budgets.default_long_tasks() == ("mqar", "lm")
    (tmp_path / "nowhere" / "python-stdlib").mkdir(parents=True)
    (tmp_path / "nowhere" / "python-stdlib" / "train.jsonl").write_text("")
    assert budgets.default_long_tasks() == ("mqar", "code_lm")


def test_the_long_budget_trains_at_long_lengths():
    budget = LONG
    assert budget.tasks["mqar"].seq_len >= 4096 and budget.tasks["code_lm"].seq_len >= 4096
    assert budget.tasks["mqar_512"].task_name("mqar_512") == "mqar"
    assert budget.seeds >= 3 and budget.tasks["mqar"].stages[-1].options == {}
    assert {"full", "linear", "local", "topk", "mita", "meta", "meta_tokens", "expanding"} <= set(
        budget.mechanisms
    )


def test_routed_budgets_are_in_keys_at_long_lengths():
    """Every routed query reads about 64 keys at T = 4096: no budget grows with T there."""
    from routeformer.compare.budgets import TOPK_KEYS, options_for

    for length in (512, 4096, 16384):
        assert options_for("local", length) == {"window": TOPK_KEYS}
        assert options_for("meta", length) == {"window": TOPK_KEYS}
        assert options_for("topk", length) == {"topk": TOPK_KEYS}
        assert options_for("mita", length)["topk"] == TOPK_KEYS
    assert options_for("local", 128) == {"window": 32}  # short lengths keep T/4 (compare --quick)


def test_position_section_averages_buckets_over_seeds_beside_the_floors():
    def record(seed, early, late):
        return {"seed": seed, "tests": {"64": {"bits_per_char_by_position": {"0-32": early, "32-64": late},
                                               "tokens_by_position": {"0-32": 32, "32-64": 32}}}}

    runs = {"full": [record(0, 2.0, 1.0), record(1, 2.2, 1.2)],
            "local": [record(0, 2.0, 1.5), record(1, 2.0, 1.7)]}
    floor = {"position_baselines": {"bigram (bits/char)": {"0-32": 3.5, "32-64": 3.25}}}
    lines = position_section(runs, "64", floor)
    table = lines[1]
    assert "| full | 2.100 ± 0.141 | 1.100 ± 0.141 |" in table
    assert "| local | 2.000 ± 0.000 | 1.600 ± 0.141 |" in table
    assert "| floor: bigram (bits/char) | 3.500 | 3.250 |" in table
    assert "0-32: 32" in lines[0]
    runs["local"][0]["tests"]["64"].pop("bits_per_char_by_position")  # a record of old: no section
    assert position_section(runs, "64", floor) == []


def test_meta_costs_are_timed_at_the_trained_shares_past_the_warmup():
    from routeformer.compare.costs import measure_beside_full, trained_routing_shares

    hard = {"hard_fraction": 1.0, "rows_full": 0.02, "rows_linear": 0.98, "rows_local": 0.0}
    records = [{"tests": {"32": hard}}, {"tests": {"32": {**hard, "rows_full": 0.04, "rows_linear": 0.96}}}]
    assert trained_routing_shares(records, 32) == pytest.approx((0.03, 0.97, 0.0))
    assert trained_routing_shares([{"tests": {"32": {**hard, "hard_fraction": 0.5}}}], 32) is None
    assert trained_routing_shares([{"tests": {"32": {"accuracy": 1.0}}}], 32) is None  # no router
    setup = toy_budget().tasks["mqar"]
    measured = measure_beside_full("mqar", "meta", setup, toy_budget().spec, lambda name: setup.options, 1,
                                   routing_shares=(0.25, 0.75, 0.0))
    assert measured["routing_shares"] == (0.25, 0.75, 0.0) and measured["train_ms_per_step"] > 0


def test_position_deltas_pair_seeds_and_star_a_gap_beyond_three_sd():
    def record(seed, early, late):
        return {"seed": seed, "tests": {"64": {"bits_per_char_by_position": {"0-32": early, "32-64": late},
                                               "tokens_by_position": {"0-32": 32, "32-64": 32}}}}

    runs = {"full": [record(0, 2.0, 1.0), record(1, 2.2, 1.2)],
            "local": [record(1, 2.2, 1.7), record(0, 2.1, 1.5)]}  # seed order differs: paired by seed
    deltas = position_section(runs, "64", {})[3]
    assert "| local | +0.050 ± 0.071 | +0.500 ± 0.000 * |" in deltas


def test_copy_section_gives_bits_on_copy_predictable_characters_and_the_paired_gap():
    def record(seed, c8, c16):
        return {"seed": seed, "tests": {"64": {"bits_per_char_copy_predictable": {"8": c8, "16": c16},
                                               "copy_predictable_fraction": {"8": 0.2, "16": 0.1}}}}

    runs = {"full": [record(0, 0.5, 0.4), record(1, 0.7, 0.6)],
            "local": [record(0, 1.5, 1.4), record(1, 1.8, 1.6)]}
    floor = {"copy_predictable_baselines": {"copy-predictable fraction": {"8": 0.2, "16": 0.1},
                                            "bigram (bits/char)": {"8": 3.0, "16": 2.9}}}
    intro, table = copy_section(runs, "64", floor)
    assert "c = 8: 0.200, c = 16: 0.100" in intro
    assert "| full | 0.600 ± 0.141 | — | 0.500 ± 0.141 | — |" in table
    assert "| local | 1.650 ± 0.212 | +1.050 ± 0.071 * | 1.500 ± 0.141 | +1.000 ± 0.000 * |" in table
    assert "| floor: bigram (bits/char) | 3.000 |  | 2.900 |  |" in table
    assert copy_section({"full": [{"seed": 0, "tests": {"64": {}}}]}, "64", floor) == []


def test_training_section_follows_the_last_bucket_along_the_stage_at_t():
    setup = curriculum_setup({"seq_len": 64}, stages=(
        Stage({"seq_len": 32}, Schedule(steps=10, batch_size=4, lr=1e-3, warmup_steps=1)),
        Stage({}, Schedule(steps=20, batch_size=2, lr=1e-3, warmup_steps=1))))

    def entry(stage, step, late, copy):
        return {"stage": stage, "step": step, "bits_per_char_by_position": {"0-32": 9.0, "32-64": late},
                "bits_per_char_copy_predictable": {"8": copy, "16": 0.0}}

    runs = {"full": [{"seed": 0, "validation": [entry(0, 10, 5.0, 5.0), entry(1, 10, 2.0, 1.0),
                                                 entry(1, 20, 1.0, 0.5)]},
                     {"seed": 1, "validation": [entry(1, 10, 3.0, 2.0), entry(1, 20, 2.0, 1.5)]}],
            "local": [{"seed": 0, "validation": [entry(1, 10, 2.5, 2.5), entry(1, 20, 2.4, 2.4)]}]}
    intro, table = training_section(runs, setup)
    assert "32-64 bucket" in intro
    # tokens: the first stage's 10 x 4 x 32, then 2 x 64 per step at T
    assert "| 10 | 0.0 | 2.500 | 1.500 | 2.500 | 2.500 |" in table
    assert "| 20 | 0.0 | 1.500 | 1.000 | 2.400 | 2.400 |" in table
    assert "full: copy-predictable (c = 8)" in table
    # with the cost table: seconds at T = steps x ms per step
    _, timed = training_section(runs, setup, {"full": {"train_ms_per_step": 500.0},
                                               "local": {"train_ms_per_step": 250.0}})
    assert "| 20 | 0.0 | 10 | 1.500 | 1.000 | 5 | 2.400 | 2.400 |" in timed
