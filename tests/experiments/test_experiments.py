"""Experiment plumbing at toy size: the registry, resumable runs."""

import json

import pytest
import torch

from routeformer.experiments.registry import list_experiments, run_experiment
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.runner.jobs import cached_run
from routeformer.runner.report import markdown_table
from tests.extras import require


def test_registry_lists_the_topk_experiments_and_rejects_unknown_names(tmp_path):
    assert {"topk-previous-token", "topk-position-lm", "topk-speed"} <= set(list_experiments())
    with pytest.raises(ValueError, match="unknown experiment 'nope'; available: "):
        run_experiment("nope", tmp_path)


def test_cached_run_computes_once(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"value": len(calls)}

    assert cached_run(tmp_path, "a", compute) == {"value": 1}
    assert cached_run(tmp_path, "a", compute) == {"value": 1}  # read back, not recomputed
    assert len(calls) == 1 and (tmp_path / "runs" / "a.json").exists()


def test_markdown_table_formats_floats():
    table = markdown_table(["a", "b"], [[1, 0.123456]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.1235 |"]


def test_logits_at_labels_equal_the_full_logits_there():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=20, dim=16, depth=1, heads=2, max_seq_len=12)).eval()
    tokens = torch.randint(0, 20, (2, 12))
    labels = torch.full((2, 12), -100)
    labels[0, 3], labels[1, 7] = 5, 9
    sparse = model(tokens, labels, logits_at_labels=True)
    dense = model(tokens, labels)
    torch.testing.assert_close(sparse.logits, dense.logits[labels != -100])
    torch.testing.assert_close(sparse.loss, dense.loss)
    with pytest.raises(ValueError, match="logits_at_labels=True needs labels"):
        model(tokens, logits_at_labels=True)


def test_structural_experiments_are_registered():
    expected = {"structural-multihop", "structural-recency", "structural-speed", "structural-update"}
    assert expected <= set(list_experiments())


def test_meta_attention_experiments_are_registered_and_init_runs(tmp_path):
    expected = {"meta-attention-init", "meta-attention-matched"}
    assert expected <= set(list_experiments())
    report = run_experiment("meta-attention-init", tmp_path, quick=True)
    records = json.loads((tmp_path / "result.json").read_text())["records"]
    assert all(r["finite"] and r["mean_sum_max_error"] < 1e-5 for r in records)
    small = [r for r in records if r["init"] == "gpt-0.02"]
    # Small weights: δ ≈ ln 2 for every expert, so the weights are (β + ln 2) / Σ(β + ln 2).
    assert abs(small[0]["weight_full"] - 0.192) < 0.005 and abs(small[0]["kl"] - 3.20) < 0.05
    assert "0.209" in report.read_text()


def test_mita_experiments_are_registered_and_train_at_toy_size(tmp_path):
    require("sklearn", "vision")
    from routeformer.experiments.mita import train_vit

    names = {"mita-digits-vit", "mita-listops", "mita-listops-long", "mita-speed"}
    assert names <= set(list_experiments())
    _, record = train_vit("mita", {"landmarks": 4, "topk": 4}, size=8, seed=0, steps=1)
    assert len(record["history"]) == 1 and 0.0 <= record["accuracy"] <= 1.0
    assert record["attention_flops_per_image"] > 0


def test_a_digits_vit_run_is_a_call_job_whose_record_is_stored_and_read_back(tmp_path):
    require("sklearn", "vision")
    from routeformer.experiments.mita import train_vit, vit_record
    from routeformer.runner.jobs import Call, call, one_thread, run_jobs

    arguments = {"mechanism": "full", "options": {}, "size": 8, "seed": 0, "steps": 2}
    job = Call("S8-full-seed0", vit_record, arguments)
    record = run_jobs(tmp_path, [job], 1, lambda line: None, train=call)["S8-full-seed0"]
    assert (tmp_path / "runs" / "S8-full-seed0.json").exists()
    with one_thread():  # as run_jobs trains each job
        _, direct = train_vit(**arguments)
    assert record["accuracy"] == direct["accuracy"] and record["history"] == direct["history"]
    # A second sweep reads the stored record instead of training again.
    again = run_jobs(tmp_path, [Call("S8-full-seed0", _refuse, {})], 1, lambda line: None, train=call)
    assert again["S8-full-seed0"] == record


def _refuse() -> dict:
    raise AssertionError("a stored run was trained again")


def test_each_central_claim_at_length_is_a_reproduce_name_that_runs_its_compare_subset(tmp_path):
    from routeformer.experiments.central_claims import CLAIMS

    assert set(CLAIMS) <= set(list_experiments())
    report = run_experiment("adsr-recall-4096", tmp_path, quick=True)
    text = report.read_text()
    assert "routeformer reproduce adsr-recall-4096 --quick" in text
    result = json.loads((tmp_path / "result.json").read_text())
    assert {record["mechanism"] for record in result["records"]} == {"full", "topk"}
    assert {record["task"] for record in result["records"]} == {"mqar"}
