"""`routeformer compare` at toy size: selection errors, statistics, the report, resume, the CLI."""

import json

import pytest

from routeformer.cli import main
from routeformer.compare import budgets, costs
from routeformer.compare.budgets import CompareBudget, check_selection
from routeformer.compare.run import run_compare
from routeformer.compare.stats import pareto_front, separated
from routeformer.runner import jobs
from routeformer.runner.jobs import TaskSetup
from routeformer.runner.report import mean_sd
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule


def toy_budget(seeds=2):
    def setup(options, test=16):
        return TaskSetup(options, Schedule(steps=2, batch_size=4, lr=1e-3, warmup_steps=1), evals=1,
                         validation_sequences=8, test_sequences=test)
    return CompareBudget("toy", tasks={
        "lm": setup({"corpus": "pydoc", "seq_len": 32}),
        "mqar": setup({"seq_len": 32, "pairs": 4, "vocab_size": 32}),
        "listops": setup({"seq_len": 32, "max_length": 31, "pool": 400})},
        seeds=seeds, spec=ModelSpec(dim=16, depth=1, heads=2), bench_lengths=(64,), repeats=1)


def test_selection_is_checked_against_the_registry():
    mechanisms, tasks = check_selection(None, None)
    assert mechanisms[0] == "full" and {"topk", "meta", "meta_tokens"} <= set(mechanisms)
    assert tasks == ["lm", "mqar", "listops"]
    assert check_selection(None, None, budgets.QUICK)[0] == ["full", *[m for m in budgets.QUICK.mechanisms
                                                                        if m != "full"]]
    with pytest.raises(ValueError, match=r"mechanisms: unknown \['nope'\]; registered: "):
        check_selection(["full", "nope"], None)
    with pytest.raises(ValueError, match=r"tasks: unknown \['vision'\]; valid: \['lm', 'mqar', 'listops'\]"):
        check_selection(None, ["vision"])


def test_statistics_and_pareto_front():
    assert mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert mean_sd([5.0]) == (5.0, 0.0)
    assert separated((1.0, 0.1), (1.31, 0.05)) and not separated((1.0, 0.1), (1.29, 0.05))
    assert separated((1.0, 0.0), (0.25, 0.0)) and not separated((0.5, 0.0), (0.5, 0.0))
    points = {"a": (1.0, 2.0), "b": (2.0, 2.5), "c": (3.0, 1.5), "d": (0.5, 3.0), "e": (3.0, 1.5)}
    assert pareto_front(points, higher_is_better=False) == {"a", "c", "d", "e"}
    assert pareto_front(points, higher_is_better=True) == {"d"}


def test_options_scale_with_the_task_length():
    assert budgets.options_for("local", 128) == {"window": 32}
    assert budgets.options_for("topk", 32) == {"topk": 4}
    # a budget in keys from T=512 on, not T/8
    assert budgets.options_for("topk", 512) == budgets.options_for("topk", 4096) == {"topk": 64}
    assert budgets.options_for("mita", 4096) == {"landmarks": 64, "topk": 64, "block": 64}
    assert budgets.options_for("mita", 128) == {"landmarks": 16, "topk": 16, "block": 16}
    assert budgets.options_for("full", 32) == {}


def test_toy_compare_writes_the_report_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "compare"
    report = run_compare(out, mechanisms=["full", "local", "meta_tokens"], budget=toy_budget(), workers=1)
    result = json.loads((out / "result.json").read_text())
    assert set(result["tasks"]) == {"lm", "mqar", "listops"}
    lm = {row["mechanism"]: row for row in result["tasks"]["lm"]["rows"]}
    assert set(lm) == {"full", "local", "meta_tokens"}  # meta_tokens only on the LM
    assert {row["mechanism"] for row in result["tasks"]["mqar"]["rows"]} == {"full", "local"}
    for row in lm.values():
        assert len(row["qualities"]) == 2 and row["seeds"] == [0, 1]
        assert row["quality_mean"] == pytest.approx(sum(row["qualities"]) / 2)
        assert row["parameters"] > 0 and row["train_step_ms"] > 0 and row["inference_ms"] > 0
    assert lm["full"]["flops_vs_full"] == 1.0 and 0 < lm["local"]["flops_vs_full"] < 1
    mqar_floor = result["tasks"]["mqar"]["floor"]
    assert mqar_floor["chance"] == pytest.approx(1 / 16) and len(mqar_floor["baselines"]) == 3
    assert {(row["T"], row["mechanism"]) for row in result["bench"]} == {(64, "full"), (64, "local"),
                                                                           (64, "meta_tokens")}
    text = report.read_text()
    for heading in ("## lm", "## mqar", "## listops", "shortcut rules", "mean ± sd", "params"):
        assert heading in text
    # the same seed gives every mechanism the same batches: the records say which seed they used
    runs = sorted(p.name for p in (out / "runs").glob("toy-mqar-*-seed*.json"))
    assert runs == ["toy-mqar-full-seed0.json", "toy-mqar-full-seed1.json",
                    "toy-mqar-local-seed0.json", "toy-mqar-local-seed1.json"]

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(jobs, "train_job", must_not_run)
    monkeypatch.setattr(costs, "measure_alone", must_not_run)
    run_compare(out, mechanisms=["full", "local", "meta_tokens"], budget=toy_budget(), workers=1)


def test_same_seed_same_batches_across_mechanisms():
    from routeformer.tasks import build_task
    from routeformer.train.on_task import train_on_task
    from routeformer.train.task_loop import TaskTrainConfig

    task = build_task("mqar", seq_len=32, pairs=4, vocab_size=32)
    original = task.batch
    inputs = {}
    for mechanism in ("full", "linear"):
        drawn = []
        task.batch = lambda size, generator, split="train", drawn=drawn: drawn.append(
            original(size, generator, split)) or drawn[-1]
        train_on_task(task, mechanism, {}, seed=3, spec=ModelSpec(dim=16, depth=1, heads=2),
                      train=TaskTrainConfig(Schedule(steps=3, batch_size=4, lr=1e-3, warmup_steps=50),
                                            eval_every=3, seed=3),
                      validation_sequences=8, test_sequences=8)
        inputs[mechanism] = [batch[0] for batch in drawn]
    assert len(inputs["full"]) == 5 and all(  # 3 training batches, the validation and test samples
        bool((a == b).all()) for a, b in zip(inputs["full"], inputs["linear"], strict=True))


def test_compare_cli_rejects_bad_input_in_one_line(tmp_path, capsys):
    assert main(["compare", "--mechanisms", "nope", "--out", str(tmp_path)]) == 2
    assert "mechanisms: unknown ['nope']" in capsys.readouterr().err
    assert main(["compare", "--seeds", "0", "--out", str(tmp_path)]) == 2
    assert "seeds must be a positive integer" in capsys.readouterr().err


def test_a_failing_run_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    original = jobs.train_job

    def broken_local(job):
        if job.mechanism == "local":
            raise RuntimeError("kernel exploded")
        return original(job)

    monkeypatch.setattr(jobs, "train_job", broken_local)
    report = run_compare(tmp_path, mechanisms=["full", "local"], tasks=["mqar"], budget=toy_budget(),
                         workers=1, bench=False)
    text = report.read_text()
    assert "local seed 0: RuntimeError: kernel exploded" in text and "| full |" in text.replace("★ ", "")
    assert not list((tmp_path / "runs").glob("toy-mqar-local-*.json"))  # not stored: a re-run retries


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("budget", [[], ["--long"]], ids=["quick", "long"])
def test_compare_on_cuda_without_a_gpu_is_one_line_and_writes_nothing(tmp_path, capsys, budget):
    out = tmp_path / "compare"
    assert main(["compare", *budget, "--device", "cuda", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("routeformer: error: argument --device: 'cuda' but no CUDA device is "
                                    "available; use cpu or auto")
    assert captured.out == "" and not out.exists()


def test_compare_refuses_a_device_torch_does_not_know_before_writing(tmp_path):
    out = tmp_path / "compare"
    with pytest.raises(ValueError, match=r"^device: a torch device such as 'cpu' or 'cuda:0'; got 'gpu0'$"):
        run_compare(out, mechanisms=["full"], tasks=["mqar"], budget=toy_budget(), workers=1, device="gpu0")
    assert not out.exists()


def test_model_overrides_train_their_own_runs_beside_the_budgets(tmp_path):
    out = tmp_path / "compare"
    plain = run_compare(out, mechanisms=["full"], tasks=["mqar"], budget=toy_budget(), workers=1, bench=False)
    assert "--model" not in plain.read_text()
    report = run_compare(out, mechanisms=["full"], tasks=["mqar"], budget=toy_budget(), workers=1,
                         bench=False, model={"dim": 8, "depth": 2})
    records = {path.stem: json.loads(path.read_text())
               for path in (out / "runs").glob("toy*-mqar-full-seed*.json")}
    assert sorted(records) == ["toy-depth2-dim8-mqar-full-seed0", "toy-depth2-dim8-mqar-full-seed1",
                               "toy-mqar-full-seed0", "toy-mqar-full-seed1"]
    assert records["toy-depth2-dim8-mqar-full-seed0"]["model"] == {"dim": 8, "depth": 2, "heads": 2,
                                                                  "mlp_ratio": 2.0, "positions": "learned"}
    assert records["toy-mqar-full-seed0"]["model"]["dim"] == 16
    text = report.read_text()
    assert "--model.dim 8 --model.depth 2" in text and "D=8" in text
    # A change that leaves the backbone as it is names nothing new.
    assert budgets.with_backbone(toy_budget(), {"dim": 16}).name == "toy"


@pytest.mark.parametrize("model, message", [
    ({"width": 8}, r"^model.width: not a backbone field; the fields are \['dim'"),
    ({"heads": 3}, r"^model.heads: must divide model.dim 16; got 3$"),
    ({"positions": "abs"}, r"^model.positions: one of \['learned', 'rotary', 'none'\]; got 'abs'$"),
    ({"dropout": 1.5}, r"^dropout: a number in \[0, 1\); got 1.5$"),
])
def test_a_bad_model_override_is_refused_before_anything_is_written(tmp_path, model, message):
    out = tmp_path / "compare"
    with pytest.raises(ValueError, match=message):
        run_compare(out, mechanisms=["full"], tasks=["mqar"], budget=toy_budget(), workers=1, model=model)
    assert not out.exists()


def test_compare_takes_model_overrides_on_its_command_line(tmp_path, capsys):
    assert main(["compare", "--quick", "--model.heads", "3", "--out", str(tmp_path / "c")]) == 2
    assert "model.heads: must divide model.dim 64; got 3" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    assert main(["compare", "--model.dim", "0", "--out", str(tmp_path / "c")]) == 2
    assert "--model.dim" in capsys.readouterr().err and not (tmp_path / "c").exists()
