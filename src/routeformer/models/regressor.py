"""A minimal attention-only regressor for the structural-inference toy problems.

input vectors [B, T, d_in] -> linear embedding -> `depth` attention layers, each added to the
residual stream (no MLP, no norm: the toy problems test what attention itself can route) ->
linear read-out at the last position -> [B, d_out].
"""

from __future__ import annotations

from typing import Any

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
