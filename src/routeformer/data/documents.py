"""Packed language-model batches: windows of a corpus that carry document ids.

A corpus is one long token stream; `document_starts` marks where a new document begins: the token
after every blank line (the separator "\n\n", encoded with the run's tokeniser; with a BPE model
that merges it differently inside text, fewer boundaries are found). `packed_random_batch` draws
the same random windows as `batches.random_batch` (the same generator call) and adds

- `documents` long [B, T]: a document id per token, nondecreasing along each row (0 for the part
  of a document the window starts in, +1 at every document start), the layout the attention
  layers and the Transformer take as `documents=` (ops/documents.py);
- labels -100 at each document's last token, whose next token is the next document's first: the
  loss is then exactly the documents' own next-token loss, each read alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.data.batches import IGNORE_INDEX

DOCUMENT_SEPARATOR = "\n\n"


def document_starts(ids: Tensor, separator_ids: Tensor) -> Tensor:
    """Bool [N] over a token stream: True at the token right after each occurrence of
    `separator_ids` (and at position 0)."""
    starts = torch.zeros(len(ids), dtype=torch.bool)
    if len(ids):
        starts[0] = True
    width = len(separator_ids)
    if width == 0 or len(ids) <= width:
        return starts
    match = torch.ones(len(ids) - width + 1, dtype=torch.bool)
    for offset in range(width):
        match &= ids[offset:len(ids) - width + 1 + offset] == separator_ids[offset]
    # A match at i covers ids[i : i + width]; the next document begins at i + width.
    after = match[:len(ids) - width].nonzero().flatten() + width
    starts[after] = True
    return starts


def packed_random_batch(
    ids: Tensor, starts: Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs, labels, documents) [B, T]: `random_batch`'s windows, with document ids and no label
    across a document boundary (module docstring). `starts` is `document_starts(ids, ...)`."""
    if len(ids) < seq_len + 1:
        raise ValueError(f"the text has {len(ids)} tokens; seq_len={seq_len} needs at least {seq_len + 1}")
    # The draw of batches.random_batch, so a packed run reads the same windows as a plain one.
    window_starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator)
    windows = ids[window_starts[:, None] + torch.arange(seq_len + 1)]
    inputs, labels = windows[:, :-1], windows[:, 1:]
    positions = window_starts[:, None] + torch.arange(seq_len + 1)
    begins = starts[positions]  # [B, T + 1]: does token t of the window (or the label after it) start a doc
    begins[:, 0] = False
    documents = begins[:, :-1].long().cumsum(1)
    labels = labels.masked_fill(begins[:, 1:], IGNORE_INDEX)
    return inputs, labels, documents
