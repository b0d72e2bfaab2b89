"""`mita`: compress-and-route attention (MiTA, Wen et al., arXiv 2602.01219).

Landmark queries (average-pooled queries) probe every key: their top-K keys form E deformable
experts, and their softmax-weighted values form one shared compressed expert. Every query reads
the shared expert and the R experts whose landmarks it matches best (see `routeformer.ops.mita`
for the algorithm, the causal variant and its diagram).

Presets (`preset=`):
- "mita" (default): shared expert + routed experts, as configured;
- "agent": topk = 0, compression only — Agent attention (queries -> landmarks -> keys);
- "route_only": no shared expert, each query reads only its routed experts' keys.
A preset overrides the `topk` / `shared` arguments it sets.

`landmarks`, `topk` and `route` may be changed at inference without retraining (`set_budget`):
the layer has no parameter whose shape depends on them.

stats: `flops` (executed), `flops_vs_full` (against dense attention over the same N),
`expert_load_max` (the busiest expert's share of routed queries times E: 1 = perfectly balanced).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.attention.base import AttentionLayer, AttentionOutput
from routeformer.attention.registry import register_attention
from routeformer.ops._checks import check_positive
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.mita import DEFAULT_PACK, check_mita_args, mita_attention

PRESETS: dict[str, dict[str, object]] = {
    "mita": {},
    "agent": {"topk": 0, "shared": True},
    "route_only": {"shared": False},
}


@register_attention("mita")
class MitaAttention(AttentionLayer):
    """MiTA attention with E `landmarks`, `topk` keys per expert and `route` experts per query.

    Vision inputs: `grid=(h, w)` pools the landmarks in 2-D over the token grid, and
    `extra_tokens` leading tokens (a CLS token) are left out of the pooling. `pack` is the number
    of queries per packed block of one expert (a speed knob; results do not depend on it).
    """

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, landmarks: int = 25, topk: int = 25,
        route: int = 1, shared: bool = True, preset: str = "mita",
        grid: tuple[int, int] | list[int] | None = None, extra_tokens: int = 0,
        pack: int = DEFAULT_PACK, **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}; got {preset!r}")
        settings = {"topk": topk, "shared": shared, **PRESETS[preset]}
        check_positive("pack", pack)
        self.preset, self.pack = preset, pack
        self.grid = None if grid is None else tuple(grid)
        self.extra_tokens = extra_tokens
        self.shared = bool(settings["shared"])
        self.set_budget(landmarks=landmarks, topk=settings["topk"], route=route)

    def set_budget(self, *, landmarks: int | None = None, topk: int | None = None,
                   route: int | None = None) -> None:
        """Change E, K or R (e.g. at inference; the paper's robustness study). None keeps a value."""
        landmarks = getattr(self, "landmarks", None) if landmarks is None else landmarks
        topk = getattr(self, "topk", None) if topk is None else topk
        route = getattr(self, "route", None) if route is None else route
        # Validated against the smallest input that fits them; each call checks its own length.
        length = self.extra_tokens + (landmarks if self.grid is None else self.grid[0] * self.grid[1])
        check_mita_args(length, landmarks=landmarks, topk=topk, route=route, causal=self.causal,
                        grid=self.grid, extra_tokens=self.extra_tokens)
        if not self.shared and topk == 0:
            raise ValueError("topk=0 without the shared expert leaves a query nothing to read; "
                             "use preset='agent' (shared, topk=0) or topk >= 1")
        self.landmarks, self.topk, self.route = landmarks, topk, route

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None
    ) -> AttentionOutput:
        mask, positions = self.check_inputs(x, mask, positions)
        q, k, v = self.project_qkv(x, positions)
        result = mita_attention(
            q, k, v, landmarks=self.landmarks, topk=self.topk, route=self.route, shared=self.shared,
            causal=self.causal, grid=self.grid, extra_tokens=self.extra_tokens, mask=mask,
            pack=self.pack,
        )
        batch, heads, length, dim = q.shape
        full = batch * heads * dense_attention_flops(length * length, dim)
        load = result.expert_load
        stats = {
            "flops": torch.tensor(float(result.flops)),
            "flops_vs_full": torch.tensor(result.flops / full),
            "expert_load_max": (load.max() * load.numel()).detach().float(),
        }
        out = self.out_proj(self.merge_heads(result.out, x))
        return AttentionOutput(out=out, aux_loss=x.new_zeros(()), stats=stats)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", preset={self.preset!r}, landmarks={self.landmarks}, "
                f"topk={self.topk}, route={self.route}, shared={self.shared}, grid={self.grid}, "
                f"extra_tokens={self.extra_tokens}")
