"""Experiment plumbing at toy size: registry, resumable runs, one MQAR cell."""

import json

import pytest
import torch

from routeformer.experiments.registry import list_experiments, run_experiment
from routeformer.experiments.report import cached_run, markdown_table
from routeformer.experiments.topk import run_mqar_variant
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM


def test_registry_lists_the_topk_experiments_and_rejects_unknown_names(tmp_path):
    assert {"topk-mqar", "topk-lm", "topk-speed"} <= set(list_experiments())
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


@pytest.mark.parametrize("mechanism, options", [("full", {}), ("topk", {"topk": 8})])
def test_one_mqar_cell_trains_and_reports(mechanism, options):
    record = run_mqar_variant(256, mechanism, options, steps=2, seed=0, eval_sequences=64, test_sequences=64)
    assert record["steps"] == 2 and len(record["history"]) == 2
    assert 0.0 <= record["final"]["accuracy"] <= 1.0
    assert ("routing_recall" in record["final"]) == (mechanism == "topk")
    assert record["attention_flops_per_token"] > 0


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
    expected = {"structural-multihop", "structural-expanding", "structural-expanding-long", "structural-lm"}
    assert expected <= set(list_experiments())


def test_structural_toy_runs_train_and_report():
    from routeformer.experiments.structural import run_multihop_model, run_recency_model
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
    expected = {"meta-attention-init", "meta-attention-ablation", "meta-attention-long"}
    assert expected <= set(list_experiments())
    report = run_experiment("meta-attention-init", tmp_path, quick=True)
    import json

    records = json.loads((tmp_path / "result.json").read_text())["records"]
    assert all(r["finite"] and r["mean_sum_max_error"] < 1e-5 for r in records)
    small = [r for r in records if r["init"] == "gpt-0.02"]
    # Small weights: δ ≈ ln 2 for every expert, so the weights are (β + ln 2) / Σ(β + ln 2).
    assert abs(small[0]["weight_full"] - 0.192) < 0.005 and abs(small[0]["kl"] - 3.20) < 0.05
    assert "0.209" in report.read_text()


def test_meta_hard_evaluation_reports_each_threshold(tmp_path):
    from routeformer.experiments.common import run_lm_variant
    from routeformer.experiments.meta_attention import hard_evaluation

    text = tmp_path / "tiny.txt"  # a small corpus keeps the final evaluation short
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    corpus = f"text:{text}"
    record = run_lm_variant(tmp_path / "run", "meta", {"window": 4}, steps=2, corpus=corpus, seq_len=16,
                            batch_size=4, log_stats=("kl", "projected_cost"),
                            after_training=hard_evaluation(corpus, 16, 4, 256, etas=(0.0,)))
    soft, hard = record["evaluations"]
    assert soft["eta"] is None and soft["routing"]["hard_fraction"] == 0
    assert hard["eta"] == 0.0 and hard["routing"]["hard_fraction"] == 1
    assert hard["attention_flops_per_token"] < soft["attention_flops_per_token"]
    assert [h["step"] for h in record["history"]] == [1, 2] and "attn_kl" in record["history"][0]
    from routeformer.experiments.meta_attention import routing_map

    png = routing_map(tmp_path / "run", tmp_path / "map.png", characters=64, width=16)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the `plots` extra is optional: no PNG, no error
        assert png is None
    else:
        assert png is not None and png.stat().st_size > 1000


def test_mita_experiments_are_registered_and_train_at_toy_size(tmp_path):
    from routeformer.experiments.mita import train_vit

    names = {"mita-digits-vit", "mita-listops", "mita-lm", "mita-speed"}
    assert names <= set(list_experiments())
    _, record = train_vit("mita", {"landmarks": 4, "topk": 4}, size=8, seed=0, steps=1)
    assert len(record["history"]) == 1 and 0.0 <= record["accuracy"] <= 1.0
    assert record["attention_flops_per_image"] > 0


def test_meta_token_experiments_run_at_toy_size_and_share_their_models(tmp_path, monkeypatch):
    import routeformer.experiments.meta_tokens as meta_tokens

    names = {"meta-tokens-tasks", "meta-tokens-length", "meta-tokens-sharpening", "meta-tokens-caching",
             "meta-tokens-lm"}
    assert names <= set(list_experiments())
    monkeypatch.setattr(meta_tokens, "TEST_SEQUENCES", 8)
    monkeypatch.setattr(meta_tokens, "_settings", lambda quick: (("copying",), (0,), 2))
    reports = {}
    for name in ("tasks", "length", "sharpening", "caching"):
        out = tmp_path / name
        out.mkdir()
        reports[name] = getattr(meta_tokens, f"run_{name}")(out, True).read_text()
    assert "| copying |" in reports["tasks"] and "acc 2.0x" in reports["length"]
    models = sorted(p.name for p in (tmp_path / "models" / "meta-tokens").glob("*.pt"))
    # tasks trains the rotary pair; length adds learned ones, the zero-trained variants and (for
    # copying) the ablation without meta-attention.
    assert len(models) == 10, models
    assert any("nometaattn" in name for name in models)
    length = json.loads((tmp_path / "length" / "result.json").read_text())["results"]
    assert all(0.0 <= value <= 1.0 for entry in length for value in entry["accuracy"].values())


def test_answer_accuracy_and_attention_entropy_measure_what_they_say():
    from routeformer.experiments.meta_tokens import (
        RecallModelSpec,
        answer_accuracy,
        attention_entropy_at_answers,
        caching_similarity,
    )
    from routeformer.models.heads import CausalLM
    from routeformer.tasks.recall_sequences import ANSWER, RecallTask, recall_batch

    spec = RecallModelSpec("list_recall", True)
    torch.manual_seed(0)
    model = CausalLM(spec.model_config()).eval()
    inputs, labels = recall_batch(spec.recall_task(), 6, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(inputs).logits
    asked = labels != -100
    expected = (logits[asked].argmax(-1) == labels[asked]).float().mean().item()
    assert answer_accuracy(model, inputs, labels, batch_size=4) == pytest.approx(expected)
    # Zero query/key projections: every attention row is uniform, entropy ln(i + 1) at position i.
    for block in model.backbone.blocks:
        with torch.no_grad():
            block.attention.qkv_proj.weight[: 2 * model.config.dim].zero_()
    positions = (inputs == ANSWER).nonzero()[:, 1].float()
    uniform_entropy = float(torch.log(positions + 1).mean())
    assert attention_entropy_at_answers(model, inputs) == pytest.approx(uniform_entropy, rel=1e-5)
    probe = caching_similarity(model, inputs, span=RecallTask().segment_length + 3)
    assert len(probe) == model.config.depth
    kinds = ("meta", "random", "centred_meta", "centred_random")
    assert all(-1.0 <= layer[kind] <= 1.0 for layer in probe for kind in kinds)


@pytest.mark.parametrize("options", [{}, {"identity": True}, {"form": "authors"}])
def test_chain_attention_reads_the_multihop_path_weights(options):
    """The reported weights are the mean path matrix the layer applies, taken from the op's
    dense reference with V = I (any form, identity path or not)."""
    from routeformer.experiments.structural import chain_attention
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


def test_mqar_grid_writes_its_report_and_skips_finished_runs(tmp_path, monkeypatch):
    from routeformer.experiments import topk as topk_experiments
    from routeformer.tasks.mqar import MQAR

    variants = {"full": ("full", {}),
                "topk(K=2,distill)": ("topk", {"topk": 2, "routing_learning": "distill"})}
    grid = topk_experiments.MQARGrid(tasks={16: MQAR(seq_len=16, pairs=2, vocab_size=16)}, steps=2,
                                     batch_size=2, variants=lambda length: variants, note="a toy task")
    text = topk_experiments._run_mqar_grid(tmp_path, "toy-mqar", False, grid).read_text()
    assert "a toy task" in text and "| 16 | 2 | topk(K=2,distill) |" in text
    monkeypatch.setattr(topk_experiments, "run_mqar_variant", lambda *args, **kw: pytest.fail("retrained"))
    topk_experiments._run_mqar_grid(tmp_path, "toy-mqar", False, grid)
    assert "topk-mqar-small" in list_experiments()
