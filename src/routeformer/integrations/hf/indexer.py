"""DeepSeek-V3.2's indexer (transformers' `DeepseekV32Indexer`) scored in query blocks: the same
top-k indices, without the dense [B, S, H, T] score tensor.

    model = transformers.DeepseekV32ForCausalLM(config)   # any attn_implementation
    patch_indexer(model)                                   # every layer's indexer, in place

What the indexer computes (transformers' forward, which `indexer_topk_reference` restates): per query
s and key t, score[b, s, t] = sum_h w[b, s, h] * relu(scale * q[b, s, h, :] . k[b, t, :]) in fp32
(q, k after the half-split rotary embedding on their first qk_rope_head_dim features; w the head
weights times n_heads ** -0.5; scale = index_head_dim ** -0.5), then the attention mask (bool: False
becomes -inf; float: added), then the indices of the min(index_topk, T) largest scores, int32
[B, S, topk], sorted by score.

transformers computes this densely: q . k through a broadcast matmul that copies the keys once per
query ([B, S, D, T]), all [B, S, H, T] scores at once, and a top-k over all T keys of every query.
`indexer_topk` takes `block` queries at a time and scores only the keys some query of the block may
read (the mask's last allowed key of the block; with the causal mask, the block's last position),
so memory is O(B * block * H * T) and the causal prefix costs about half the dense work. Per block:
one matmul [B, block * H, D] x [B, D, L] for q . k, the same scale, ReLU and head-weighted matmul as
transformers, the mask, a top-(k+1) over the L scored keys.

Why the indices are transformers' own, ties included: torch's top-k breaks ties by where equal
values sit in a row of a given length (the ReLU makes exact ties common: a key no head scores
positively is worth exactly 0), so a top-k over a shorter row may pick other tied keys. A query whose
k+1 largest scores in its block are all distinct has one answer whatever the row length; every other
query (a tie among its top k+1, masked keys among its top k) is answered by a top-k over its full
row of T scores, the unscored keys holding what transformers gives them (-inf for a bool mask; the
mask value for a float mask, exact while |score| < 1e30). The indices then equal transformers',
element for element, whenever the block matmul rounds the scores as the broadcast one does (on the
CPU builds tested it does, bit for bit); where a BLAS rounds them differently, two keys whose scores
differ by a rounding error may swap at the k-th place.

`patch_indexer` checks, before changing anything, that each indexer's own forward gives the same
indices as the blocked one on a small random input (so a transformers release whose indexer
computes something else is refused rather than silently replaced).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.integrations.hf.compat import passed_cache
from routeformer.ops._checks import check_positive

# Axis letters: B batch, S queries, T keys, H indexer heads, D index head dim, L scored keys of a block.

DEFAULT_BLOCK = 128
BLOCK_ATTRIBUTE = "routeformer_query_block"
_PROBE_LENGTH = 29
_PROBE_BLOCK = 4


def _check_inputs(q: Tensor, k: Tensor, weights: Tensor, attention_mask: Tensor, topk: int) -> None:
    if q.dim() != 4 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q must be [B, S, H, D] and k [B, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if weights.shape != q.shape[:3]:
        raise ValueError(f"weights must be [B, S, H] = {tuple(q.shape[:3])}; got {tuple(weights.shape)}")
    batch, length, _, _ = q.shape
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 3 \
            or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[1:] != (length, k.shape[1]):
        shape = (tuple(attention_mask.shape) if isinstance(attention_mask, Tensor)
                 else type(attention_mask).__name__)
        raise ValueError(f"attention_mask must be [B or 1, S, T] = [{batch} or 1, {length}, {k.shape[1]}] "
                         f"(bool or additive float); got {shape}")
    check_positive("topk", topk)


def indexer_scores_reference(q: Tensor, k: Tensor, weights: Tensor, attention_mask: Tensor,
                             softmax_scale: float) -> Tensor:
    """transformers' dense index scores, fp32 [B, S, T]: sum_h weights[b, s, h] *
    relu(softmax_scale * q[b, s, h] . k[b, t]), then the mask (bool False -> -inf, float added).

    q [B, S, H, D] (after rotary), k [B, T, D], weights fp32 [B, S, H] (already times n_heads ** -0.5),
    attention_mask bool or float [B or 1, S, T]. The specification `indexer_topk` is tested against."""
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        return index_scores.masked_fill(~attention_mask, float("-inf"))
    return index_scores + attention_mask


def indexer_topk_reference(q: Tensor, k: Tensor, weights: Tensor, attention_mask: Tensor, topk: int,
                           softmax_scale: float) -> Tensor:
    """transformers' indices: the min(topk, T) largest `indexer_scores_reference`, int32 [B, S, topk]."""
    _check_inputs(q, k, weights, attention_mask, topk)
    index_scores = indexer_scores_reference(q, k, weights, attention_mask, softmax_scale)
    return index_scores.topk(min(topk, index_scores.shape[-1]), dim=-1).indices.to(torch.int32)


def _column_bounds(mask: Tensor, key_numbers: Tensor) -> tuple[int, int]:
    """(first, reach) of a block's mask [B or 1, rows, T]: every row may read every key before
    `first`; no row may read a key from `reach` on. A float mask forbids a key at its dtype's
    minimum or -inf."""
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    allowed = allowed.flatten(0, 1).view(torch.uint8)  # uint8 reductions over rows are the fast ones
    reach = int((allowed.amax(0) * key_numbers).max())
    blocked = (allowed.amin(0) == 0).nonzero()
    return (int(blocked[0]) if blocked.numel() else mask.shape[-1]), reach


def _largest(values: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The `count` largest entries of each row of `values` [..., L] (values sorted descending, and
    their indices), as values.topk(count) gives them where a row's `count` largest values are
    distinct (where they tie, other tied entries may be named). A long row is cut into n groups of
    c keys (group j: keys j, j + n, j + 2n, ...): the `count` largest values lie in the `count`
    groups with the largest maxima, so top-k reads n group maxima and count * c candidates instead
    of all L scores."""
    length = values.shape[-1]
    size = int(math.sqrt(length / count))
    if size < 2 or count * size + length // size > length // 2:
        return values.topk(count, dim=-1)
    groups = -(-length // size)
    padded = nn.functional.pad(values, (0, groups * size - length), value=float("-inf"))
    best = padded.view(*values.shape[:-1], size, groups).amax(-2).topk(count, dim=-1).indices
    members = torch.arange(0, groups * size, groups, device=values.device)
    candidates = (best.unsqueeze(-1) + members).flatten(-2)
    top, where = padded.gather(-1, candidates).topk(count, dim=-1)
    # a padded slot (index >= L) can only hold -inf, at a place where -inf ties or is cut off
    return top, candidates.gather(-1, where)


def indexer_topk(q: Tensor, k: Tensor, weights: Tensor, attention_mask: Tensor, topk: int,
                 softmax_scale: float, block: int = DEFAULT_BLOCK) -> Tensor:
    """The indices `indexer_topk_reference` returns, int32 [B, S, min(topk, T)], computed `block`
    queries at a time over the keys the mask lets the block read (module docstring: when they equal
    the reference element for element, and why ties do too).

    q [B, S, H, D] (after rotary; any float dtype, scored in fp32), k [B, T, D], weights fp32
    [B, S, H], attention_mask bool (True = may read) or additive float [B or 1, S, T], topk >= 1,
    softmax_scale the q . k scale, block >= 1 queries per block. Extra memory O(B * block * H * T).
    Raises ValueError on shapes that do not fit or a non-positive topk or block."""
    _check_inputs(q, k, weights, attention_mask, topk)
    check_positive("block", block)
    batch, length, heads, dim = q.shape
    keys = k.shape[1]
    count = min(topk, keys)
    out = torch.empty(batch, length, count, dtype=torch.int32, device=q.device)
    if count == 0 or length == 0 or batch == 0:
        return out
    q, k = q.float(), k.float()
    key_numbers = torch.arange(1, keys + 1, device=q.device)
    is_bool = attention_mask.dtype == torch.bool
    for start in range(0, length, block):
        stop = min(length, start + block)
        rows = stop - start
        mask = attention_mask[:, start:stop]
        # L: up to the block's last readable key, at least count + 1 keys (for the tie check).
        first, reach = _column_bounds(mask, key_numbers)
        scored = min(keys, max(reach, count + 1))
        scores = torch.matmul(q[:, start:stop].reshape(batch, rows * heads, dim),
                              k[:, :scored].transpose(1, 2)).view(batch, rows, heads, scored)
        scores.mul_(softmax_scale).relu_()
        index_scores = torch.matmul(weights[:, start:stop].unsqueeze(-2), scores).squeeze(-2)  # [B, rows, L]
        del scores
        if is_bool:  # the keys before `first` are readable by every row: nothing to fill there
            if first < scored:
                index_scores[..., first:].masked_fill_(~mask[..., first:scored], float("-inf"))
        else:
            index_scores = index_scores + mask[..., :scored]
        if scored == keys:  # the full row: transformers' top-k on the same values
            out[:, start:stop] = index_scores.topk(count, dim=-1).indices
            continue
        values, indices = _largest(index_scores, count + 1)
        out[:, start:stop] = indices[..., :count]
        tied = (values[..., 1:] == values[..., :-1]).any(-1)  # [B, rows]
        if not bool(tied.any()):
            continue
        row_batch, row = tied.nonzero(as_tuple=True)
        full = index_scores.new_empty(row_batch.shape[0], keys)
        full[:, :scored] = index_scores[row_batch, row]
        if is_bool:
            full[:, scored:] = float("-inf")
        else:  # score + mask rounds to the mask value at the dtype's minimum
            full[:, scored:] = mask[row_batch if mask.shape[0] > 1 else 0, row, scored:].float()
        out[row_batch, row + start] = full.topk(count, dim=-1).indices.to(torch.int32)
    return out


def _indexer_inputs(module: nn.Module, hidden_states: Tensor, q_resid: Tensor,
                    position_embeddings: tuple[Tensor, Tensor], cache: Any) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, S, H, D], k [B, T, D] (the cached keys too) and fp32 head weights [B, S, H] as
    transformers' indexer forms them: half-split rotary on the first qk_rope_head_dim features of
    wq_b(q_resid) and k_norm(wk(hidden_states)), weights_proj(hidden_states) * n_heads ** -0.5."""
    apply_rotary = importlib.import_module(type(module).__module__).apply_rotary_pos_emb
    batch, length, _ = hidden_states.shape
    rope = module.qk_rope_head_dim
    split = [rope, module.head_dim - rope]
    cos, sin = position_embeddings
    q = module.wq_b(q_resid).view(batch, length, module.n_heads, module.head_dim)
    q_rot, q_pass = torch.split(q, split, dim=-1)
    k = module.k_norm(module.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, split, dim=-1)
    q_rot, k_rot = apply_rotary(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, module.layer_idx)
    weights = module.weights_proj(hidden_states.to(module.weights_proj.weight.dtype)).float()
    return q, k, weights * module.n_heads ** -0.5


@torch.no_grad()
def blocked_indexer_forward(self: nn.Module, hidden_states: Tensor, q_resid: Tensor,
                            position_embeddings: tuple[Tensor, Tensor], attention_mask: Tensor,
                            position_ids: Tensor | None = None, cache: Any = None,
                            past_key_values: Any = None) -> Tensor:
    """`DeepseekV32Indexer.forward` with `indexer_topk` (block = the module's
    `routeformer_query_block`, default DEFAULT_BLOCK): int32 [B, S, topk] top-k key indices. Takes
    the cache as `cache` (transformers >= 5.24) or `past_key_values` (earlier); position_ids unused,
    as in transformers."""
    cache = passed_cache((), {}, past_key_values, cache)
    q, k, weights = _indexer_inputs(self, hidden_states, q_resid, position_embeddings, cache)
    return indexer_topk(q, k, weights, attention_mask, self.index_topk, self.softmax_scale,
                        getattr(self, BLOCK_ATTRIBUTE, DEFAULT_BLOCK))


def _indexer_class() -> type:
    import transformers

    if importlib.util.find_spec("transformers.models.deepseek_v32") is None:
        raise ValueError(f"transformers {transformers.__version__} has no DeepSeek-V3.2 "
                         "(DeepseekV32Indexer was added in transformers 5.11.0)")
    modeling = importlib.import_module("transformers.models.deepseek_v32.modeling_deepseek_v32")
    return modeling.DeepseekV32Indexer


_ATTRIBUTES = ("wq_b", "wk", "k_norm", "weights_proj", "n_heads", "head_dim", "qk_rope_head_dim",
               "index_topk", "softmax_scale", "layer_idx", "hidden_size", "q_lora_rank")
_PARAMETERS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask")


def _refusal(module: nn.Module) -> str | None:
    """Why the blocked forward would not stand in for this indexer, or None: missing attributes or
    forward arguments, or different indices on a small random input than its own forward."""
    missing = [name for name in _ATTRIBUTES if not hasattr(module, name)]
    if missing:
        return f"it has no {', '.join(missing)}"
    parameters = list(inspect.signature(type(module).forward).parameters)[1:5]
    if tuple(parameters) != _PARAMETERS:
        return f"its forward takes ({', '.join(parameters)}, ...), not ({', '.join(_PARAMETERS)}, ...)"
    weight = module.wq_b.weight
    generator = torch.Generator().manual_seed(0)
    length = _PROBE_LENGTH

    def sample(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator).to(device=weight.device, dtype=weight.dtype)

    hidden_states, q_resid = sample(1, length, module.hidden_size), sample(1, length, module.q_lora_rank)
    angles = torch.rand(1, length, module.qk_rope_head_dim // 2, generator=generator) * 6.3
    angles = torch.cat([angles, angles], dim=-1).to(weight.device)
    position_embeddings = (angles.cos().to(weight.dtype), angles.sin().to(weight.dtype))
    mask = torch.ones(length, length, dtype=torch.bool, device=weight.device).tril()
    mask[:, :3] = False  # a padded start
    mask = mask.unsqueeze(0)
    topk = module.index_topk
    try:
        module.index_topk = min(topk, 6)  # short rows: the prefix, tie and full-row paths all run
        with torch.no_grad():
            own = type(module).forward(module, hidden_states, q_resid, position_embeddings, mask, None)
            q, k, weights = _indexer_inputs(module, hidden_states, q_resid, position_embeddings, None)
            blocked = indexer_topk(q, k, weights, mask, module.index_topk, module.softmax_scale,
                                   _PROBE_BLOCK)
            scores = indexer_scores_reference(q, k, weights, mask, module.softmax_scale)
    finally:
        module.index_topk = topk
    if own.shape != blocked.shape:
        return (f"its forward returns {tuple(own.shape)} indices where the blocked one returns "
                f"{tuple(blocked.shape)}")
    # tie-aware: the same scores in the same order (equal keys may be swapped)
    if not torch.allclose(scores.gather(-1, own.long()), scores.gather(-1, blocked.long()),
                          rtol=1e-4, atol=1e-6):
        return "its forward picks other keys than the blocked one on a random input"
    return None


def patch_indexer(model: nn.Module, *, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Give every DeepSeek-V3.2 indexer (`DeepseekV32Indexer`) of `model` the blocked forward
    (`blocked_indexer_forward`, `block` queries at a time), in place; returns the model. Weights,
    state dict and the attention implementation are unchanged; calling it again sets the new block.
    The patch is not saved: a reloaded model has transformers' forward until patched again.

    Raises TypeError if `model` is not an nn.Module; ValueError if block is not a positive int, if
    transformers has no DeepSeek-V3.2, if the model has no indexer, or (before anything is changed)
    if an indexer's own forward computes other indices than the blocked one."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (a DeepseekV32ForCausalLM); got {type(model).__name__}")
    check_positive("block", block)
    indexer_class = _indexer_class()
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, indexer_class)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no DeepSeek-V3.2 indexer (DeepseekV32Indexer)")
    for name, module in found:
        reason = _refusal(module)
        if reason is not None:
            raise ValueError(f"{type(model).__name__}.{name} ({type(module).__name__}): the blocked indexer "
                             f"cannot stand in for it: {reason}; leaving the model unchanged")
    for _, module in found:
        setattr(module, BLOCK_ATTRIBUTE, block)
        module.forward = MethodType(blocked_indexer_forward, module)
    return model
