"""Packed documents for any attention layer: run each document separately, in groups.

`layer(x, documents=ids)` (ids [B, T], nondecreasing per row; see ops/documents.py) computes, for
every document, what the layer computes on that document alone: no attention across documents,
positions restarting at 0 in each document (unless `positions` are passed, which are then used
as given). A mechanism with its own segmented path (`local`: the window restricted to the same
document, in one call) overrides `AttentionLayer.forward_documents`; every other one runs here:

1. the documents are grouped by length (ops/documents.py `document_groups`: causal layers in
   power-of-two length classes padded at the end, at most 2x the tokens; bidirectional layers by
   exact length, no padding), so each group is one ordinary [n, L, D] call with a padding mask;
2. each group runs through the layer's own forward (its fast paths, its native kernels);
3. the real rows are scattered back into [B, T, D].

Exact by the layer contract (docs/design.md): a causal layer's first t outputs depend neither on later
tokens nor on the length, and padded rows never move real ones. Memory O(B·T·D) for the gathered
copies plus the layer's own O(T) memory per group; time: the layer's, on at most 2x the tokens,
in at most log2(T) + 1 calls (bidirectional: one call per distinct length). One host sync to plan.

A call advances the layer's integer buffers (step counters: meta's `routing_step`) once, as an
unpacked call does; every group sees the value the call started from.

`aux_loss` is the mean of the groups' aux losses weighted by their real tokens, which equals the
aux loss of all documents run as one padded batch when it is a mean over real tokens (meta's ELBO
term, topk's distillation loss). `stats`: keys named `flops` or `*_flops` are summed over groups;
other stats are the same token-weighted mean (dropped when their shapes differ between groups).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.attention.output import AttentionOutput
from routeformer.ops.documents import document_groups, document_positions


def run_per_document(
    layer, x: Tensor, *, mask: Tensor | None, positions: Tensor | None, documents: Tensor, **extra
):
    """`layer`'s output on a packed batch x [B, T, D], each document run alone (module docstring).

    `extra` keyword tensors of shape [B, T, ...] (meta_mask, say) are gathered with the tokens;
    any other value is passed to every call unchanged."""
    batch, length, dim = x.shape
    if positions is None:
        positions = document_positions(documents)
    flat_x = x.reshape(batch * length, dim)
    flat_positions = positions.reshape(-1)
    flat_mask = None if mask is None else mask.reshape(-1)
    groups = document_groups(documents, exact_lengths=not layer.causal)
    # Integer buffers are step counters (meta's routing_step, which anneals eta): every group must
    # see the value this call started from, and the call must advance it once, not once per group.
    counters = [b for b in layer.buffers() if not b.is_floating_point() and not b.is_complex()]
    started = [b.clone() for b in counters]
    outputs, order, weights, results = [], [], [], []
    for group in groups:
        for counter, value in zip(counters, started, strict=True):
            counter.copy_(value)
        inside = group.inside
        padded = not bool(inside.all())
        offsets = torch.arange(inside.shape[1], device=x.device)
        # Padded slots continue their document's positions (any value would do: they are masked).
        group_positions = torch.where(inside, flat_positions[group.index],
                                      flat_positions[group.first][:, None] + offsets)
        group_mask = None
        if padded or flat_mask is not None:
            group_mask = inside if flat_mask is None else inside & flat_mask[group.index]
        group_extra = {
            name: _gather(value, group.index, inside, batch, length) for name, value in extra.items()
        }
        result = layer(flat_x[group.index], mask=group_mask, positions=group_positions, **group_extra)
        outputs.append(result.out[inside])
        order.append(group.index[inside])
        real = inside if group_mask is None else group_mask
        weights.append(real.sum().to(torch.float32))
        results.append(result)
    if len(results) == 1:
        out, aux_loss, stats = torch.cat(outputs), results[0].aux_loss, results[0].stats
    else:
        out = torch.cat(outputs)
        total = torch.stack(weights).sum().clamp_min(1.0)
        aux_loss = sum(r.aux_loss * (w / total).to(r.aux_loss.device)
                       for r, w in zip(results, weights, strict=True))
        stats = _merge_stats([r.stats for r in results], [w / total for w in weights])
    scatter = torch.cat(order)
    restore = torch.empty_like(scatter)
    restore[scatter] = torch.arange(scatter.numel(), device=scatter.device)
    out = out[restore].view(batch, length, -1)
    return AttentionOutput(out=out, aux_loss=aux_loss, stats=stats)


def _gather(value, index: Tensor, inside: Tensor, batch: int, length: int):
    if not isinstance(value, Tensor) or value.shape[:2] != (batch, length):
        return value
    gathered = value.reshape(batch * length, *value.shape[2:])[index]
    if gathered.dtype == torch.bool:  # a flag (meta_mask): padded slots hold no flagged token
        gathered = gathered & inside.view(*inside.shape, *([1] * (gathered.dim() - 2)))
    return gathered


def _merge_stats(all_stats: list[dict[str, Tensor]], shares: list[Tensor]) -> dict[str, Tensor]:
    merged: dict[str, Tensor] = {}
    for key in all_stats[0]:
        values = [stats.get(key) for stats in all_stats]
        if any(v is None for v in values) or len({tuple(v.shape) for v in values}) != 1:
            continue
        if key == "flops" or key.endswith("_flops"):
            merged[key] = sum(v.float() for v in values)
        else:
            merged[key] = sum(v.float() * s.to(v.device) for v, s in zip(values, shares, strict=True))
    return merged
