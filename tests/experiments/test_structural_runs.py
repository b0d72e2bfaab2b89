"""The structural toy runs (experiments/structural_runs.py): training, the report fields, the path weights."""

import pytest
import torch


def test_structural_toy_runs_train_and_report():
    from routeformer.experiments.structural_runs import run_multihop_model, run_recency_model
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


@pytest.mark.parametrize("options", [{}, {"identity": True}, {"form": "authors"}])
def test_chain_attention_reads_the_multihop_path_weights(options):
    """The reported weights are the mean path matrix the layer applies, taken from the op's
    dense reference with V = I (any form, identity path or not)."""
    from routeformer.experiments.structural_runs import chain_attention
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
