"""Packed sequences: several documents in one row, told apart by document ids.

Axes: B batch, T length, N documents (over the whole batch), L the longest document of a group.

A packed batch carries `documents`, an integer tensor [B, T], nondecreasing along each row: a
document is a maximal run of equal ids in a row (rows never share a document, whatever their ids).
This is the layout of FlexAttention's document masks; `documents_from_cu_seqlens` converts the
varlen layout of flash-attn / flash-linear-attention (`cu_seqlens`, cumulative document lengths
over one flattened row) into it, `cu_seqlens_from_documents` goes back.

`document_positions` restarts positions at 0 in every document, so rotary / learned positions (and
position-aware routers) see each document exactly as they would see it alone.

`document_groups` plans how to run documents separately (attention/documents.py): documents of
similar length are gathered into one padded [n, L] batch. `exact_lengths=False` groups lengths
in (2^(j-1), 2^j] (each group padded to its own longest document, so at most 2x the tokens, and
at most log2(T) + 1 groups): exact for causal layers, whose first t outputs depend neither on
later tokens nor on the total length. `exact_lengths=True` groups equal lengths only (no padding):
for bidirectional layers, whose outputs may depend on the length. Memory O(B·T) either way, never
a T x T mask. Planning reads the document lengths on the host (one device sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def check_documents(documents: Tensor, batch: int, length: int) -> None:
    """Raise ValueError unless `documents` is an integer [B, T] tensor, nondecreasing per row."""
    if not isinstance(documents, Tensor) or documents.dtype not in (
            torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        kind = documents.dtype if isinstance(documents, Tensor) else type(documents).__name__
        raise ValueError(f"documents must be an integer tensor of document ids [B, T]; got {kind}")
    if documents.shape != (batch, length):
        raise ValueError(f"documents must have shape [B, T] = {(batch, length)}; "
                         f"got {tuple(documents.shape)}")
    if length > 1 and bool((documents[:, 1:] < documents[:, :-1]).any()):
        raise ValueError("documents must be nondecreasing along each row (a document is a run of equal "
                         "ids; pack each document into one contiguous stretch)")


def document_starts(documents: Tensor) -> Tensor:
    """Bool [B, T]: True where a document begins (position 0 of every row, and every id change)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    if documents.shape[1] > 1:
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def document_positions(documents: Tensor) -> Tensor:
    """Long [B, T]: each token's position inside its document (0 at every document start)."""
    batch, length = documents.shape
    index = torch.arange(length, device=documents.device).expand(batch, length)
    start_index = torch.where(document_starts(documents), index, torch.zeros_like(index))
    return index - start_index.cummax(dim=1).values


def documents_from_cu_seqlens(cu_seqlens: Tensor | list[int], length: int | None = None) -> Tensor:
    """`cu_seqlens` [N + 1] (0, len_0, len_0 + len_1, ..., total; the flash-attn varlen layout over
    one flattened row) -> document ids long [1, T], T = `length` (default: cu_seqlens[-1]).
    Tokens past cu_seqlens[-1] (when `length` is larger) form one more document (padding, say)."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.long)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be a 1-D nondecreasing integer sequence starting at 0; "
                         f"got {cu.tolist()}")
    total = int(cu[-1])
    length = total if length is None else length
    if length < total:
        raise ValueError(f"length={length} is shorter than cu_seqlens[-1]={total}")
    ids = torch.searchsorted(cu[1:], torch.arange(length, device=cu.device), right=True)
    return ids[None]


def cu_seqlens_from_documents(documents: Tensor) -> Tensor:
    """Document ids [B, T] -> `cu_seqlens` long [N + 1] over the flattened batch (rows in order;
    a document never spans two rows)."""
    starts = document_starts(documents).flatten().nonzero().flatten()
    end = torch.tensor([documents.numel()], device=documents.device)
    return torch.cat([starts, end])


@dataclass
class DocumentGroup:
    """Documents run together: `index` [n, L] flat token indices into the [B·T] batch (0 in padded
    slots), `inside` [n, L] True on real slots, `first` [n] each document's first flat index."""

    index: Tensor
    inside: Tensor
    first: Tensor


def document_groups(documents: Tensor, *, exact_lengths: bool) -> list[DocumentGroup]:
    """Group the documents of a packed batch for separate runs; see the module docstring."""
    starts = document_starts(documents).flatten().nonzero().flatten()  # [N]
    ends = torch.cat([starts[1:], torch.tensor([documents.numel()], device=starts.device)])
    lengths = ends - starts
    if exact_lengths:
        keys = lengths
    else:  # ceil(log2(length)): lengths in (2^(j-1), 2^j] share a group
        keys = torch.ceil(torch.log2(lengths.double())).long()
    groups = []
    for key in torch.unique(keys).tolist():
        chosen = (keys == key).nonzero().flatten()
        first, size = starts[chosen], lengths[chosen]
        width = int(size.max())
        offsets = torch.arange(width, device=starts.device)
        inside = offsets[None, :] < size[:, None]
        index = torch.where(inside, first[:, None] + offsets[None, :],
                            torch.zeros_like(inside, dtype=torch.long))
        groups.append(DocumentGroup(index, inside, first))
    return groups
