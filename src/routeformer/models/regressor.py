"""A minimal attention-only regressor for the structural-inference toy problems.

input vectors [B, T, d_in] -> linear embedding -> `depth` attention layers, each added to the
residual stream (no MLP, no norm: the toy problems test what attention itself can route) ->
linear read-out at the last position -> [B, d_out].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.attention import build_attention
from routeformer.models.heads import ModelOutput
from routeformer.ops._checks import check_positive


class SequenceRegressor(nn.Module):
    """`mechanisms` names one attention layer per depth (e.g. ["full", "full"] or ["multihop"]);
    `causal=False` lets every node read every other (the read-out is at the last position either way)."""

    def __init__(
        self, mechanisms: list[str], input_dim: int, model_dim: int, target_dim: int, *, heads: int = 1,
        causal: bool = True, attention_options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        if not mechanisms:
            raise ValueError("mechanisms must name at least one attention layer")
        for name, value in (("input_dim", input_dim), ("model_dim", model_dim), ("target_dim", target_dim)):
            check_positive(name, value)
        options = attention_options or {}
        self.embed = nn.Linear(input_dim, model_dim)
        self.layers = nn.ModuleList(
            build_attention(name, dim=model_dim, heads=heads, causal=causal, **options.get(name, {}))
            for name in mechanisms
        )
        self.readout = nn.Linear(model_dim, target_dim)

    def hidden_states(self, x: Tensor) -> tuple[list[Tensor], Tensor, list[dict[str, Tensor]], Tensor]:
        """(input of every layer, final residual stream, per-layer stats, summed aux loss)."""
        hidden = self.embed(x)
        inputs, stats, aux = [], [], hidden.new_zeros(())
        for layer in self.layers:
            inputs.append(hidden)
            result = layer(hidden)
            hidden = hidden + result.out
            stats.append(result.stats)
            aux = aux + result.aux_loss
        return inputs, hidden, stats, aux

    def forward(self, x: Tensor, target: Tensor | None = None) -> ModelOutput:
        """Prediction at the last position (`logits` holds it); MSE `loss` when `target` is given."""
        _, hidden, stats, aux = self.hidden_states(x)
        prediction = self.readout(hidden[:, -1])
        loss = None if target is None else F.mse_loss(prediction, target)
        return ModelOutput(logits=prediction, loss=loss, aux_loss=aux, stats=stats)


ATTENTION_FREE = ("none", "position-only")


class AttentionFreeRegressor(nn.Module):
    """SequenceRegressor's model with its attention layer replaced by an attention-free mixer:
    embedding -> mixer added to the residual stream -> linear read-out at the last position.

    - "none": no mixer; the read-out sees the last node only (the model with attention removed).
    - "position-only": a content-blind causal mixer, out_t = W_o Σ_δ softmax(w)_δ W_v h_{t-δ}
      with one learned logit w_δ per distance (softmax over the distances a position can reach):
      the best any rule that weights positions by distance alone can do (a fixed recency profile).
    """

    def __init__(self, mixer: str, input_dim: int, model_dim: int, target_dim: int, length: int) -> None:
        super().__init__()
        if mixer not in ATTENTION_FREE:
            raise ValueError(f"mixer must be one of {ATTENTION_FREE}; got {mixer!r}")
        self.mixer = mixer
        self.embed = nn.Linear(input_dim, model_dim)
        self.readout = nn.Linear(model_dim, target_dim)
        if mixer == "position-only":
            self.distance_logits = nn.Parameter(torch.zeros(length))
            self.value = nn.Linear(model_dim, model_dim, bias=False)
            self.out_proj = nn.Linear(model_dim, model_dim, bias=False)

    def forward(self, x: Tensor, target: Tensor | None = None) -> ModelOutput:
        hidden = self.embed(x)
        if self.mixer == "position-only":
            length = x.shape[1]
            if length > self.distance_logits.shape[0]:
                raise ValueError(f"x has {length} positions; the mixer was built for at most "
                                 f"{self.distance_logits.shape[0]}")
            position = torch.arange(length, device=x.device)
            distance = position[:, None] - position[None, :]
            logits = self.distance_logits[distance.clamp(min=0)].masked_fill(distance < 0, float("-inf"))
            hidden = hidden + self.out_proj(logits.softmax(dim=-1) @ self.value(hidden))
        prediction = self.readout(hidden[:, -1])
        loss = None if target is None else F.mse_loss(prediction, target)
        return ModelOutput(logits=prediction, loss=loss, aux_loss=hidden.new_zeros(()), stats=[])
