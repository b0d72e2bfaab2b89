"""Meta-token injection and loss masking ("Language Modeling with Learned Meta-Tokens", Shah et al.,
arXiv 2509.16278).

During pre-training the paper inserts the reserved token `_PAUSE_` at random positions at
density 0.1. The model reads meta-tokens but is never asked to predict one: a target that is a
meta-token gets label -100 (IGNORE_INDEX). The token after a meta-token is still predicted — from
the meta-token's position.

Our rule for a window of `seq_len` slots at density ρ: m = round(ρ · seq_len) slots, drawn
uniformly without replacement per sequence (seeded), hold `_PAUSE_`; the other seq_len − m slots
hold consecutive real tokens. The window length (what attention costs) stays seq_len; each window
carries ρ fewer real tokens than a plain one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.data.batches import IGNORE_INDEX

DEFAULT_DENSITY = 0.1


def check_density(name: str, density: float) -> float:
    if not 0.0 <= density < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the fraction of slots that hold a meta-token); "
                         f"got {density!r}")
    return float(density)


def meta_count(seq_len: int, density: float) -> int:
    """How many of `seq_len` slots hold a meta-token at `density` (at most seq_len - 1)."""
    check_density("density", density)
    return min(round(density * seq_len), seq_len - 1)


def inject_meta_tokens(
    windows: Tensor, seq_len: int, *, meta_id: int, density: float = DEFAULT_DENSITY,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Inject meta-tokens into windows of real tokens.

    `windows` [B, n + 1]: consecutive real tokens, n = seq_len - meta_count(seq_len, density) (the
    extra last token is the target of the window's last slot). Returns (inputs [B, seq_len],
    labels [B, seq_len]): labels[t] is the next slot's token, or -100 where that token is a
    meta-token.
    """
    batch = windows.shape[0]
    real = real_tokens_per_window(seq_len, density)
    if windows.dim() != 2 or windows.shape[1] != real + 1:
        raise ValueError(f"windows must have shape [B, {real + 1}] (seq_len - meta-tokens + 1) for "
                         f"seq_len={seq_len}, density={density}; got {tuple(windows.shape)}")
    if bool((windows == meta_id).any()):
        raise ValueError(f"windows already contain the meta-token id {meta_id}")
    is_meta = torch.zeros(batch, seq_len + 1, dtype=torch.bool)
    is_meta[:, :seq_len] = random_meta_slots(batch, seq_len, density, generator)
    stream = torch.full((batch, seq_len + 1), meta_id, dtype=windows.dtype)
    stream[~is_meta] = windows.reshape(-1)  # each row has exactly real + 1 real slots, in order
    return stream[:, :-1], meta_labels(stream[:, 1:], meta_id)


def random_meta_slots(batch: int, seq_len: int, density: float,
                      generator: torch.Generator | None = None) -> Tensor:
    """bool [B, seq_len]: meta_count(seq_len, density) slots per row, uniform without replacement."""
    is_meta = torch.zeros(batch, seq_len, dtype=torch.bool)
    count = meta_count(seq_len, density)
    if count:
        slots = torch.rand(batch, seq_len, generator=generator).argsort(dim=1)[:, :count]
        is_meta.scatter_(1, slots, True)
    return is_meta


def inject_into_batch(
    inputs: Tensor, labels: Tensor, seq_len: int, *, meta_id: int, density: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """`inject_meta_tokens` for a batch of plain windows (inputs, next-token labels) [B, n],
    n = real_tokens_per_window(seq_len, density)."""
    return inject_meta_tokens(torch.cat([inputs, labels[:, -1:]], dim=1), seq_len, meta_id=meta_id,
                              density=density, generator=generator)


def meta_labels(targets: Tensor, meta_id: int) -> Tensor:
    """Next-token targets with every meta-token target replaced by -100 (no loss on predicting one)."""
    return targets.masked_fill(targets == meta_id, IGNORE_INDEX)


def real_tokens_per_window(seq_len: int, density: float) -> int:
    """Real tokens in an injected window of `seq_len` slots (its last target not counted)."""
    return seq_len - meta_count(seq_len, density)


# -- positions at meta-tokens --------------------------------------------------------------------
# The paper zeroes the positional encoding at meta-tokens (for rotary: angle 0, "position 0"). A
# query at position i then meets a meta key rotated by 0, not by its place: the score depends on i
# itself, not on the distance, so shifting the whole sequence changes the output (rotary's shift
# invariance is lost). Two schemes keep every relative position intact:
#
# - "keep": every token, meta or not, at its place in the sequence (positions 0, 1, 2, ...);
# - "skip": meta-tokens do not advance the position counter. A token's position is the number of
#   real (non-meta) tokens before it, so the real tokens stand at exactly the distances they would
#   have without meta-tokens (what a model pre-trained without them learned), and a meta-token
#   shares the position of the real token that follows it.
#
# Both are shift invariant: a prefix of r real tokens adds r to every position.
META_POSITION_SCHEMES = ("keep", "skip")


def meta_positions(meta: Tensor, scheme: str = "skip", offset: int = 0) -> Tensor:
    """Positions [B, T] long for the tokens of a batch whose meta-tokens are `meta` (bool [B, T]).

    "keep": offset + t. "skip": offset + (real tokens before t). Causal: position t depends on
    `meta` at indices < t only (so decoding token by token gives the same positions)."""
    if scheme not in META_POSITION_SCHEMES:
        raise ValueError(f"scheme must be one of {META_POSITION_SCHEMES}; got {scheme!r}")
    if meta.dtype != torch.bool or meta.dim() != 2:
        raise ValueError(f"meta must be a bool tensor [B, T]; got {meta.dtype} {tuple(meta.shape)}")
    batch, length = meta.shape
    steps = torch.ones_like(meta, dtype=torch.long) if scheme == "keep" else (~meta).long()
    before = steps.cumsum(dim=1) - steps  # exclusive: what comes before t
    return before + offset if length else before.view(batch, 0)
