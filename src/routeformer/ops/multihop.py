"""Multi-hop attention: values read along paths of up to n edges of the attention graph.

Axes: B batch, H heads, T length, d head dim.

Singh & Buckley ("Attention as Implicit Structural Inference", NeurIPS 2023, §4) read the
attention matrix P = softmax(q kᵀ / √d + log-prior) as a posterior over the edges of a graph, and
attention as the expected value function under it. One hop reads the likely neighbour j of i:
P V. Two hops also read j's likely neighbour: P (P V). The paper's mechanism is (P + P²) V; with
n hops it is (P + ... + Pⁿ) V, and `identity` adds the zero-hop path V.

Fast path: hop h is one `scaled_dot_product_attention` call whose values are the previous hop's
output, so Pʰ V = P (P^(h-1) V) costs one attention pass, and neither P nor P² is ever held.
Causal-safe: a power of a lower-triangular P is lower-triangular.

`form="authors"`: the authors' code computes ((I + P̃ + P̃²) / 3)ᵀ V with P̃ = softmax over the
*query* axis. Transposing a column-normalised matrix gives a row-normalised one whose row i is
softmax_j(q_j · k_i): query and key swap roles. So the authors' form is the mean (not the sum) of
the paths, identity included by default, with q and k exchanged. Row i then reads tokens j whose
*queries* match its key; under a causal mask that reads the future (j ≥ i), so this form is
non-causal only.

Reference: P built densely with an explicit mask, matrix powers, the authors' column softmax
written literally.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.full.op import full_attention, full_attention_flops
from routeformer.ops.full.reference import allowed_keys, masked_attention_reference

FORMS = ("paper", "authors")


def check_multihop_options(hops: int, form: str, causal: bool) -> None:
    check_positive("hops", hops)
    if form not in FORMS:
        raise ValueError(f"form must be one of {list(FORMS)}; got {form!r}")
    if form == "authors" and causal:
        raise ValueError(
            "form='authors' normalises over the query axis, which makes token i read tokens j >= i; "
            "it needs causal=False (use form='paper' for causal models)"
        )


def path_settings(form: str, identity: bool | None, hops: int) -> tuple[bool, float]:
    """(include the zero-hop path, weight of each path): the paper sums, the authors average."""
    identity = (form == "authors") if identity is None else identity
    weight = 1.0 / (hops + int(identity)) if form == "authors" else 1.0
    return identity, weight


def multihop_attention(
    q: Tensor, k: Tensor, v: Tensor, *, hops: int = 2, identity: bool | None = None,
    form: str = "paper", mask: Tensor | None = None, causal: bool = False, scale: float | None = None,
) -> Tensor:
    """Σ_{h=1..hops} Pʰ V (+ V with `identity`) over [B, H, T, d] tensors; see the module docstring.

    `identity=None` means the form's default: off for "paper", on for "authors".
    """
    check_qkv(q, k, v, mask, causal=True)  # paths chain tokens: queries and keys share one axis
    check_multihop_options(hops, form, causal)
    identity, weight = path_settings(form, identity, hops)
    # The authors' P̃ is ordinary attention with the roles of q and k exchanged.
    reader, written = (q, k) if form == "paper" else (k, q)
    hop, total = v, (v if identity else None)
    for _ in range(hops):
        hop = full_attention(reader, written, hop, mask=mask, causal=causal, scale=scale)
        total = hop if total is None else total + hop
    return total * weight if weight != 1.0 else total


def multihop_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, hops: int = 2, identity: bool | None = None,
    form: str = "paper", mask: Tensor | None = None, causal: bool = False, scale: float | None = None,
) -> Tensor:
    """The specification: P as a dense matrix, (Σ Pʰ) V by explicit matrix powers."""
    check_qkv(q, k, v, mask, causal=True)
    check_multihop_options(hops, form, causal)
    identity, weight = path_settings(form, identity, hops)
    batch, _, length, _ = q.shape
    eye = torch.eye(length, dtype=v.dtype, device=v.device)
    if form == "paper":
        allowed = allowed_keys(batch, length, mask, causal, q.device)
        # P = the weights masked_attention_reference applies: read them off with V = I.
        probs = masked_attention_reference(q, k, eye.expand(*q.shape[:2], length, length), allowed, scale)
    else:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = (q @ k.transpose(-1, -2)) * scale  # [.., a (query), b (key)]
        if mask is not None:  # row a of the column softmax is token a's value: drop padded a
            scores = scores.masked_fill(~mask[:, None, :, None], float("-inf"))
        probs = scores.softmax(dim=-2).transpose(-1, -2)
    paths = eye if identity else torch.zeros_like(eye)
    power = eye
    for _ in range(hops):
        power = probs @ power
        paths = paths + power
    return (paths * weight) @ v


def multihop_attention_flops(
    batch: int, heads: int, length: int, head_dim: int, hops: int, causal: bool, masked: bool = False,
) -> int:
    """Executed FLOPs: `hops` attention passes (the identity path and the sum are O(T·d))."""
    return hops * full_attention_flops(batch, heads, length, length, head_dim, causal, masked)
