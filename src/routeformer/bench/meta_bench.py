"""`routeformer bench meta`: the `meta` layer, soft and hard-routed, against the `full` layer.

Layers, not ops: x [B, T, D] -> out, projections included, causal, fp32. Implementations:
- full: the `full` layer (SDPA inside);
- meta(soft): every expert on every token;
- meta(hard 20/50/30): every token hard-routed, 20% to full, 50% to linear, 30% to local (drawn
  at random per token, seeded). The split is imposed by a `FixedSplitRouter` in place of the
  learned controller, so the timing measures the routed execution, not what a controller learned;
- meta(hard 20/50/30, shared qkv): the same with `share_qkv=True` (one Q/K/V projection for the
  three experts instead of three).
Speedup = t_full / t_impl in the same process, medians of alternating repetitions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from routeformer.attention import build_attention
from routeformer.bench.ops_bench import OpsRow, format_row, forward_backward_call, forward_call
from routeformer.bench.timing import median_times, peak_memory_mib

HARD_SPLIT = (0.2, 0.5, 0.3)


class FixedSplitRouter(nn.Module):
    """Stands in for `BayesianRouter`: each token gets a sharp Dirichlet on one expert, drawn with
    probabilities `split` (seeded), so a threshold of 0.5 routes every token hard."""

    def __init__(self, split: Sequence[float], seed: int = 0, sharpness: float = 50.0) -> None:
        super().__init__()
        self.split, self.seed, self.sharpness = torch.tensor(split), seed, sharpness
        self.register_buffer("prior", torch.ones(len(split)), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        choice = torch.multinomial(self.split, x.shape[0] * x.shape[1], replacement=True, generator=gen)
        one_hot = torch.nn.functional.one_hot(choice, len(self.split)).view(*x.shape[:2], -1)
        return (1.0 + self.sharpness * one_hot).to(x.dtype)


def meta_layers(dim: int, heads: int, window: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    full = build_attention("full", dim=dim, heads=heads)
    soft = build_attention("meta", dim=dim, heads=heads, window=window)
    split = "/".join(str(round(100 * share)) for share in HARD_SPLIT)
    layers = {"full": full.eval(), "meta(soft)": soft.eval()}
    for suffix, shared in (("", False), (", shared qkv", True)):
        hard = build_attention("meta", dim=dim, heads=heads, window=window, eval_eta=0.5, share_qkv=shared)
        hard.router = FixedSplitRouter(HARD_SPLIT)
        layers[f"meta(hard {split}{suffix})"] = hard.eval()
    return layers


def bench_meta(
    lengths: list[int], *, dim: int = 256, heads: int = 4, window: int = 256, batch: int = 1,
    repeats: int = 5, progress: Callable[[str], None] | None = None,
) -> tuple[list[OpsRow], list[dict]]:
    """Time every layer of `meta_layers` at each length; returns (rows, routing records).
    The rows' speedup columns are against the `full` layer."""
    layers = meta_layers(dim, heads, window)
    rows, routing = [], []
    for length in lengths:
        x = torch.randn(batch, length, dim, generator=torch.Generator().manual_seed(length))
        leaf = x.clone().requires_grad_()

        def forward(layer: nn.Module, x: Tensor = x) -> Callable[[], object]:
            return forward_call(layer, (x,))

        def forward_backward(layer: nn.Module, leaf: Tensor = leaf) -> Callable[[], None]:
            run = forward_backward_call(lambda tokens: layer(tokens).out, (leaf,))

            def step() -> None:  # weight gradients are dropped too, as in a training step
                run()
                layer.zero_grad(set_to_none=True)
            return step

        fwd = median_times({name: forward(layer) for name, layer in layers.items()}, repeats)
        fwd_bwd = median_times({name: forward_backward(layer) for name, layer in layers.items()}, repeats)
        for name, layer in layers.items():
            row = OpsRow(length, name, fwd[name] * 1e3, fwd_bwd[name] * 1e3, fwd["full"] / fwd[name],
                         fwd_bwd["full"] / fwd_bwd[name], peak_memory_mib(forward(layer)),
                         peak_memory_mib(forward_backward(layer)))
            rows.append(row)
            if progress:
                progress(format_row(row))
            if not layer.is_baseline:  # the meta layers' routing
                with torch.no_grad():
                    stats = layer(x).stats
                routing.append({"length": length, "impl": name, **{
                    key: float(stats[key]) for key in
                    ("hard_fraction", "rows_full", "rows_linear", "rows_local", "flops_vs_full")}})
    return rows, routing


META_HEADER = (
    "| T | layer | fwd ms | fwd speedup vs full | fwd+bwd ms | fwd+bwd speedup vs full | "
    "fwd peak MiB | fwd+bwd peak MiB |\n|---|---|---|---|---|---|---|---|"
)
ROUTING_HEADER = (
    "| T | layer | hard tokens | rows full | rows linear | rows local | attention FLOPs vs full |\n"
    "|---|---|---|---|---|---|---|"
)


def format_routing_row(record: dict) -> str:
    return (f"| {record['length']} | {record['impl']} | {record['hard_fraction']:.2f} | "
            f"{record['rows_full']:.2f} | {record['rows_linear']:.2f} | {record['rows_local']:.2f} | "
            f"{record['flops_vs_full']:.3f} |")
