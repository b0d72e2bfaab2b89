"""Train one model on a structural-inference toy problem (Singh & Buckley, NeurIPS 2023).

Shared by `structural_multihop` (the two-hop chain, paper Figure 2) and `structural_recency`
(the recency task, Figure 3). Every run follows the same protocol:

- the seed draws the task's weights (W_r, W_y), the training batches and the initial model, so two
  models trained with the same seed see the same task and the same batches;
- validation MSE is measured during training on held-out sequences (seed 3000 + seed), which is
  what any setup (learning rate, ...) is chosen on;
- test MSE is measured once, at the end, on other held-out sequences (seed 2000 + seed).

The held-out draws and the zero-prediction floor are the task's (tasks/structural.py); the
attention-free baselines are models (models/regressor.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from routeformer.attention import ExpandingAttention, MultihopAttention
from routeformer.models.regressor import ATTENTION_FREE, AttentionFreeRegressor, SequenceRegressor
from routeformer.ops.multihop import multihop_attention_reference, path_settings
from routeformer.tasks.structural import (
    TEST_SEQUENCES,
    StructuralTask,
    StructuralWeights,
    chain_batch,
    held_out,
    recency_batch,
)
from routeformer.train.on_task import parameter_count
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import TaskTrainConfig, layer_stat, train_task

VALIDATION_SEQUENCES = 1024
EXPANDING_BLOCK = 8
RECENCY_TEST = 512  # held-out sequences per evaluation (expanding's inference loop is per call)

# name -> (one attention layer per depth, multihop options). The last two rows check whether the
# multihop result depends on the path form: the zero-hop path added, or the authors' own form.
MULTIHOP_MODELS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "self-attention x1": (["full"], {}),
    "self-attention x2": (["full", "full"], {}),
    "multihop x1": (["multihop"], {}),
    "multihop x1 (+ identity path)": (["multihop"], {"identity": True}),
    "multihop x1 (authors form)": (["multihop"], {"form": "authors"}),
}



def _attention_matrix(layer, hidden: Tensor) -> Tensor:
    """P [B, T, T] of a single-head softmax layer, from its own projections."""
    q, k, _ = layer.project_qkv(hidden, torch.arange(hidden.shape[1]).expand(hidden.shape[:2]))
    scores = (q @ k.transpose(-1, -2))[:, 0] * q.shape[-1] ** -0.5
    if layer.causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(dim=-1)


def _mean_path_matrix(layer, hidden: Tensor) -> Tensor:
    """[B, T, T] mean of a single-head multihop layer's path matrices (any form): the op's dense
    reference with V = I gives them summed, each times the form's path weight."""
    q, k, _ = layer.project_qkv(hidden, torch.arange(hidden.shape[1]).expand(hidden.shape[:2]))
    batch, length = hidden.shape[:2]
    eye = torch.eye(length, dtype=q.dtype).expand(batch, 1, length, length)
    paths = multihop_attention_reference(q, k, eye, hops=layer.hops, identity=layer.identity, form=layer.form,
                                         causal=layer.causal)[:, 0]
    identity, weight = path_settings(layer.form, layer.identity, layer.hops)
    return paths / (weight * (layer.hops + int(identity)))


def chain_attention(model: SequenceRegressor, x: Tensor, positions: Tensor) -> dict[str, float]:
    """Mean weight the last node (x2) puts on x0 and on x1. Self-attention: the last layer's P;
    multihop: the mean of its path matrices, (P + P²) / 2 or (I + P + P²) / 3 with the identity
    path; rows sum to one like P's."""
    with torch.no_grad():
        inputs, _, _, _ = model.hidden_states(x)
        layer, hidden = model.layers[-1], inputs[-1]
        if isinstance(layer, MultihopAttention):
            probs = _mean_path_matrix(layer, hidden)
        else:
            probs = _attention_matrix(layer, hidden)
        last = probs[:, -1]  # [B, T]
        rows = torch.arange(x.shape[0])
        return {"weight_x0": float(last[rows, positions[:, 0]].mean()),
                "weight_x1": float(last[rows, positions[:, 1]].mean())}


def run_multihop_model(name: str, task: StructuralTask, steps: int, seed: int, *, lr: float = 3e-3,
                       evals: int = 20) -> dict[str, Any]:
    """Train one MULTIHOP_MODELS entry on the chain task: validation MSE every steps/evals steps,
    test MSE and the attention on x0 / x1 once at the end (`final["test_loss"]`)."""
    weights = StructuralWeights.sample(task, seed=1000 + seed)
    x_val, y_val, _ = held_out(task, chain_batch, seed, "validation", VALIDATION_SEQUENCES)
    torch.manual_seed(seed)
    # Non-causal: the nodes are a shuffled set, so x0 may sit after x1; a causal mask would cut the
    # x1 -> x0 hop for half the sequences (the paper's graph has no order).
    mechanisms, options = MULTIHOP_MODELS[name]
    model = SequenceRegressor(mechanisms, task.dim, task.dim, task.target_dim, causal=False,
                              attention_options={"multihop": options})

    def evaluate(m) -> dict[str, Any]:
        with torch.no_grad():
            return {"val_loss": float(m(x_val, y_val).loss)}

    history = train_task(
        model, lambda batch, gen: chain_batch(task, weights, batch, gen)[:2], evaluate,
        TaskTrainConfig(Schedule(steps=steps, batch_size=128, lr=lr, warmup_steps=50), weight_decay=0.0,
                        eval_every=max(1, steps // evals), seed=seed),
    )
    x_test, y_test, positions = held_out(task, chain_batch, seed, "test", TEST_SEQUENCES)
    model.eval()
    with torch.no_grad():
        test_loss = float(model(x_test, y_test).loss)
    return {"model": name, "seed": seed, "lr": lr, "parameters": parameter_count(model),
            "history": history.evals,
            "final": {**history.final, "test_loss": test_loss},
            "attention": chain_attention(model, x_test, positions),
            "train_seconds": history.train_seconds}


def run_recency_model(
    mechanism: str, task: StructuralTask, steps: int, seed: int, *, test_sequences: int = RECENCY_TEST,
    evals: int = 10, lr: float = 3e-3, options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train a one-layer causal SequenceRegressor with `mechanism` on the recency task: validation
    MSE during training, test MSE (and expanding's windows) once at the end."""
    weights = StructuralWeights.sample(task, seed=1000 + seed)
    x_val, y_val, _ = held_out(task, recency_batch, seed, "validation", test_sequences)
    torch.manual_seed(seed)
    if mechanism in ATTENTION_FREE:
        model = AttentionFreeRegressor(mechanism, task.dim, task.dim, task.target_dim, task.length)
    else:
        layer_options = {"expanding": {"block": EXPANDING_BLOCK}, **(options or {})}
        model = SequenceRegressor([mechanism], task.dim, task.dim, task.target_dim,
                                  attention_options=layer_options)

    def measure(m, x, y, prefix: str) -> dict[str, Any]:
        with torch.no_grad():
            result = m(x, y)
        flops = layer_stat(result.stats, "flops")
        record = {f"{prefix}_loss": float(result.loss),
                  "flops_per_sequence": None if flops is None else flops / x.shape[0]}
        for key in ("window_mean", "iterations_mean", "score_ops_vs_full"):
            value = layer_stat(result.stats, key)
            if value is not None:
                record[key] = value
        return record

    history = train_task(
        model, lambda batch, gen: recency_batch(task, weights, batch, gen)[:2],
        lambda m: measure(m, x_val, y_val, "val"),
        TaskTrainConfig(Schedule(steps=steps, batch_size=64, lr=lr, warmup_steps=50), weight_decay=0.0,
                        eval_every=max(1, steps // evals), seed=seed),
    )
    x_test, y_test, _ = held_out(task, recency_batch, seed, "test", test_sequences)
    model.eval()
    record = {"mechanism": mechanism, "recency": task.recency, "dim": task.dim, "seed": seed, "lr": lr,
              "parameters": parameter_count(model),
              "history": history.evals, "final": {**history.final, **measure(model, x_test, y_test, "test")},
              "train_seconds": history.train_seconds}
    if any(isinstance(module, ExpandingAttention) for module in model.modules()):  # its learned prior
        with torch.no_grad():
            record["last_query"] = _last_query_window(model, x_test)
            alpha, beta = model.layers[0].prior()
        record["learned_prior"] = {"alpha": float(alpha[0]), "beta": float(beta[0])}
    return record


def _last_query_window(model: SequenceRegressor, x: Tensor) -> dict[str, float]:
    """Final window and iterations of the query that makes the prediction (the last position)."""
    from routeformer.ops.expanding import expanding_attention

    layer = model.layers[0]
    hidden = model.embed(x)
    q, k, v = layer.project_qkv(hidden, torch.arange(x.shape[1]).expand(x.shape[:2]))
    alpha, beta = layer.prior()
    result = expanding_attention(q, k, v, alpha, beta, tol=layer.tol, max_iters=layer.max_iters,
                                 block=layer.block, update=layer.update)
    return {"window_mean": float(result.horizon[:, :, -1].float().mean()),
            "iterations_mean": float(result.iterations[:, :, -1].float().mean())}
