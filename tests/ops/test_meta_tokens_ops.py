"""ops/meta_tokens.py: the packed meta-attention against its dense twin and the paper's dense mask."""

import pytest
import torch

from routeformer.ops.full import full_attention
from routeformer.ops.meta_tokens import (
    gather_rows,
    meta_token_attention,
    meta_token_attention_dense_mask,
    meta_token_attention_flops,
    meta_token_attention_reference,
    pack_meta_positions,
)

B, H, T, D = 3, 2, 29, 8


def inputs(seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).requires_grad_(grad)
               for _ in range(3))
    meta = torch.rand(B, T, generator=gen) < 0.25
    meta[0, 0] = True  # a meta-token at the first position reads only itself
    meta[2] = False  # a sequence without meta-tokens beside ones with
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 21:] = False
    return q, k, v, meta, mask


def grads(out, tensors, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_matches_reference_forward_and_backward(causal, padded):
    q, k, v, meta, mask = inputs()
    mask = mask if padded else None
    fast = meta_token_attention(q, k, v, pack_meta_positions(meta, mask), mask=mask, causal=causal)
    slow = meta_token_attention_reference(q, k, v, meta, mask=mask, causal=causal)
    rows = 1.0 if mask is None else mask[:, None, :, None]
    torch.testing.assert_close(fast * rows, slow * rows)
    for a, b in zip(grads(fast * rows, (q, k, v)), grads(slow * rows, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_separate_projections_and_gate_match_reference(causal):
    q, k, v, meta, _ = inputs()
    gen = torch.Generator().manual_seed(5)
    meta_qkv = tuple(torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).requires_grad_()
                     for _ in range(3))
    gate = torch.rand(B, H, T, 1, generator=gen, dtype=torch.float64).requires_grad_()
    packing = pack_meta_positions(meta)
    fast = meta_token_attention(q, k, v, packing, causal=causal,
                                meta_qkv=tuple(gather_rows(t, packing.index) for t in meta_qkv),
                                meta_gate=gather_rows(gate, packing.index))
    slow = meta_token_attention_reference(q, k, v, meta, causal=causal, meta_qkv=meta_qkv, meta_gate=gate)
    torch.testing.assert_close(fast, slow)
    wrt = (q, *meta_qkv, gate)
    for a, b in zip(grads(fast, wrt), grads(slow, wrt), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_training_path_passes_gradcheck(causal):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    meta = torch.zeros(2, 9, dtype=torch.bool)
    meta[0, [1, 4, 5, 8]] = True
    meta[1, [2, 6]] = True
    packing = pack_meta_positions(meta)
    assert torch.autograd.gradcheck(lambda *t: meta_token_attention(*t, packing, causal=causal), (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_dense_mask_implementation_matches_reference(causal):
    q, k, v, meta, mask = inputs(grad=False)
    torch.testing.assert_close(meta_token_attention_dense_mask(q, k, v, meta, causal=causal),
                               meta_token_attention_reference(q, k, v, meta, causal=causal))


def test_meta_attention_only_changes_meta_rows_and_reads_only_meta_keys():
    q, k, v, meta, _ = inputs(grad=False)
    out = meta_token_attention(q, k, v, pack_meta_positions(meta), causal=True)
    standard = full_attention(q, k, v, causal=True)
    rows = meta[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[~rows], standard[~rows])
    assert (out[rows] - standard[rows]).abs().min() > 0  # every meta row gets its meta-attention
    # Changing the values of ordinary tokens moves the meta part of no meta row.
    v2 = v.clone()
    v2[~meta[:, None, :, None].expand_as(v)] += 1.0
    delta = meta_token_attention(q, k, v2, pack_meta_positions(meta)) - full_attention(q, k, v2, causal=True)
    torch.testing.assert_close(delta, out - standard)


def test_causal_meta_attention_never_reads_the_future():
    q, k, v, meta, _ = inputs(grad=False)
    base = meta_token_attention(q, k, v, pack_meta_positions(meta))
    for t in (1, 9, 20):
        k2, v2, meta2 = k.clone(), v.clone(), meta.clone()
        k2[:, :, t:] += 2.0
        v2[:, :, t:] -= 3.0
        meta2[:, t:] = ~meta2[:, t:]  # even which later tokens are meta-tokens must not matter
        out = meta_token_attention(q, k2, v2, pack_meta_positions(meta2))
        torch.testing.assert_close(out[:, :, :t], base[:, :, :t])


def test_packing_puts_meta_positions_first_in_order():
    meta = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    packing = pack_meta_positions(meta)
    assert packing.width == 3
    assert packing.counts.tolist() == [3, 1, 0]
    assert packing.index[0].tolist() == [1, 3, 4]
    assert packing.index[1, 0].item() == 0
    assert packing.valid.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    padded = pack_meta_positions(meta, torch.tensor([[1, 1, 1, 1, 0, 0]] * 3, dtype=torch.bool))
    assert packing.width == 3 and padded.counts.tolist() == [2, 1, 0]  # padding is never meta


def test_no_meta_tokens_is_standard_attention():
    q, k, v, _, _ = inputs(grad=False)
    packing = pack_meta_positions(torch.zeros(B, T, dtype=torch.bool))
    assert packing.width == 0
    torch.testing.assert_close(meta_token_attention(q, k, v, packing), full_attention(q, k, v, causal=True))


def test_flops_count_the_packed_pairs():
    q, _, _, meta, _ = inputs(grad=False)
    packing = pack_meta_positions(meta)
    m = packing.width
    standard = 4 * B * H * T * (T + 1) // 2 * D
    among_meta = 4 * B * H * m * (m + 1) // 2 * D
    assert meta_token_attention_flops(q, packing, masked=False, causal=True) == standard + among_meta


def test_bad_meta_mask_is_rejected():
    with pytest.raises(ValueError, match="meta must be a bool"):
        pack_meta_positions(torch.zeros(2, 5))
    q, k, v, meta, _ = inputs(grad=False)
    with pytest.raises(ValueError, match="packing"):
        meta_token_attention(q, k, v, pack_meta_positions(meta[:2]))
