"""Cached decoding of padded batches: each row keeps its own decode state.

A padded prompt batch (left padding, as Hugging Face users generate; right padding; any mix) has
rows of different real lengths. Every routeformer decode state (keys/values, a window, a linear
state, routing keys) counts real tokens only, so a padded batch cannot share one state. Here each
row gets its own state, and the attention of a decoding step runs row by row over that row's real
tokens: row b then generates exactly what its prompt generates alone, for every mechanism that
decodes, with no per-mechanism padding code. Embeddings, MLPs and the LM head stay batched; the
attention step costs B small calls instead of one batched call, which is the price of exactness
here (a batched ragged kernel would remove it).

A ragged layer state is a dict {"rows": [state of row 0, ...], "row_lengths": LongTensor [B]}
(real tokens seen per row). Batch-first tensors keep Hugging Face's beam reordering and batch
selection working (`select_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def is_ragged(state: dict) -> bool:
    return "rows" in state


def start_ragged(state: dict, batch: int, device: torch.device) -> None:
    """Turn an empty layer state into a ragged one for `batch` rows."""
    if state:
        raise ValueError("a padded batch must start from an empty cache (its rows keep separate states)")
    state["rows"] = [{} for _ in range(batch)]
    state["row_lengths"] = torch.zeros(batch, dtype=torch.long, device=device)


def ragged_positions(state: dict, real: Tensor) -> Tensor:
    """Positions of the new tokens [B, T]: each row counts on from its own real tokens, as the row
    alone would (pads get 0 and are never read)."""
    counted = state["row_lengths"][:, None] + real.long().cumsum(1) - 1
    return counted.clamp_min(0).masked_fill(~real, 0)


def decode_rows(attention: nn.Module, x: Tensor, real: Tensor, positions: Tensor, state: dict,
                **extra: Tensor) -> Tensor:
    """attention.decode of a padded batch, row by row: row b's real tokens (real[b]) continue that
    row's own state. x [B, T, D] -> out [B, T, D], zero at pads. `extra` holds [B, T] inputs of the
    layer (meta_mask), cut the same way."""
    if real.shape != x.shape[:2]:
        raise ValueError(f"padding mask must be [B, T] = {tuple(x.shape[:2])}; got {tuple(real.shape)}")
    rows = state["rows"]
    if len(rows) != x.shape[0]:
        raise ValueError(f"the cache holds {len(rows)} rows; this batch has {x.shape[0]}")
    out = torch.zeros_like(x)
    for row, row_state in enumerate(rows):
        keep = real[row].nonzero().squeeze(1)
        if keep.numel() == 0:
            continue
        row_extra = {name: None if value is None else value[row:row + 1, keep]
                     for name, value in extra.items()}
        out[row, keep] = attention.decode(x[row:row + 1, keep], positions=positions[row:row + 1, keep],
                                          cache=row_state, **row_extra)[0]
    state["row_lengths"] = state["row_lengths"] + real.long().sum(1)
    return out


def _copy_state(value):
    if isinstance(value, dict):
        return {key: _copy_state(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_state(item) for item in value]
    return value.clone() if isinstance(value, Tensor) else value


def select_rows(state: dict, index: Sequence[int] | Tensor) -> None:
    """Keep (and reorder, repeat) the rows `index` of a ragged state, as beam search and batch
    selection do. A row taken twice gets its own copy: decode states may be written in place."""
    index = index.tolist() if isinstance(index, Tensor) else list(index)
    seen: set[int] = set()
    rows = []
    for i in index:
        rows.append(_copy_state(state["rows"][i]) if i in seen else state["rows"][i])
        seen.add(i)
    state["rows"] = rows
    state["row_lengths"] = state["row_lengths"][torch.as_tensor(index, device=state["row_lengths"].device)]
