"""Experiment plumbing at toy size: registry, resumable runs, the structural toy runs."""

import json

import pytest
import torch

from routeformer.experiments.registry import list_experiments, run_experiment
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.runner.jobs import cached_run
from routeformer.runner.report import markdown_table


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


def test_structural_toy_runs_train_and_report():
    from routeformer.experiments.structural_toys import run_multihop_model, run_recency_model
    from routeformer.tasks.structural import StructuralTask

    chain = run_multihop_model("multihop x1", StructuralTask(length=8, dim=8, rank=2), steps=2, seed=0)
    assert len(chain["history"]) == 2 and chain["final"]["test_loss"] > 0
    # Path weights of (P + P²)/2 are probabilities.
    assert 0 <= chain["attention"]["weight_x0"] <= 1 and 0 <= chain["attention"]["weight_x1"] <= 1
    task = StructuralTask(length=32, dim=8, rank=8, recency=4.0)
    recency = run_recency_model("expanding", task, steps=4, seed=0, test_sequences=16, evals=2)
    assert len(recency["history"]) == 2, "evals sets how many evaluations the run makes"
    assert recency["final"]["flops_per_sequence"] > 0 and 1 <= recency["final"]["window_mean"] <= 32
    assert recency["learned_prior"]["alpha"] > 0 and recency["last_query"]["iterations_mean"] >= 1


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
    from routeformer.experiments.mita import train_vit

    names = {"mita-digits-vit", "mita-listops", "mita-listops-long", "mita-speed"}
    assert names <= set(list_experiments())
    _, record = train_vit("mita", {"landmarks": 4, "topk": 4}, size=8, seed=0, steps=1)
    assert len(record["history"]) == 1 and 0.0 <= record["accuracy"] <= 1.0
    assert record["attention_flops_per_image"] > 0


@pytest.mark.parametrize("options", [{}, {"identity": True}, {"form": "authors"}])
def test_chain_attention_reads_the_multihop_path_weights(options):
    """The reported weights are the mean path matrix the layer applies, taken from the op's
    dense reference with V = I (any form, identity path or not)."""
    from routeformer.experiments.structural_toys import chain_attention
    from routeformer.models.regressor import SequenceRegressor
    from routeformer.ops.multihop import multihop_attention_reference, path_settings

    torch.manual_seed(0)
    length, dim = 6, 8
    model = SequenceRegressor(["multihop"], dim, dim, 2, causal=False,
                              attention_options={"multihop": options}).eval()
    x = torch.randn(3, length, dim)
    positions = torch.tensor([[0, 1], [2, 4], [3, 1]])
    got = chain_attention(model, x, positions)
    layer = model.layers[0]
    with torch.no_grad():
        hidden = model.hidden_states(x)[0][-1]
        q, k, _ = layer.project_qkv(hidden, torch.arange(length).expand(3, length))
        eye = torch.eye(length).expand(3, 1, length, length)
        paths = multihop_attention_reference(q, k, eye, form=layer.form, identity=layer.identity)[:, 0]
    identity, weight = path_settings(layer.form, layer.identity, layer.hops)
    mean_paths = paths / weight / (layer.hops + int(identity))  # the sum of the paths, averaged
    last = mean_paths[:, -1]
    rows = torch.arange(3)
    assert got["weight_x0"] == pytest.approx(float(last[rows, positions[:, 0]].mean()), abs=1e-6)
    assert got["weight_x1"] == pytest.approx(float(last[rows, positions[:, 1]].mean()), abs=1e-6)
