"""Packed sequences (`documents=`): a packed batch equals its documents run alone."""

from __future__ import annotations

import warnings

import pytest
import torch

from routeformer.attention import build_attention, list_attentions
from routeformer.ops.documents import (
    cu_seqlens_from_documents,
    document_groups,
    document_positions,
    documents_from_cu_seqlens,
)
from routeformer.ops.local import local_attention, local_attention_reference
from tests.attention.test_invariants import DIM, HEADS, SMALL_OPTIONS

# Two rows of 24 tokens: three documents of different lengths, then two. Lengths cross the small
# windows / chunks / blocks of SMALL_OPTIONS, and 7, 5 and 3 land in different length groups.
ROW_LENGTHS = [[7, 12, 5], [16, 8]]
LENGTH = 24


def packed_ids() -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in ROW_LENGTHS])


def spans():
    """(row, start, length) of every document."""
    for row, lengths in enumerate(ROW_LENGTHS):
        start = 0
        for n in lengths:
            yield row, start, n
            start += n


def make_layer(name, causal, **extra):
    torch.manual_seed(0)
    options = {**SMALL_OPTIONS.get(name, {}), **extra}
    return build_attention(name, dim=DIM, heads=HEADS, causal=causal, **options)


def layer_grads(layer):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in layer.named_parameters()}


@pytest.mark.parametrize("name", list(list_attentions()))
@pytest.mark.parametrize("causal", [True, False])
def test_packed_batch_equals_documents_run_alone(name, causal):
    layer = make_layer(name, causal, rotary=True).eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, LENGTH, DIM, generator=gen, requires_grad=True)
    weight = torch.randn(2, LENGTH, DIM, generator=gen)
    reads_meta = getattr(layer, "reads_meta_mask", False)
    meta_mask = torch.arange(LENGTH).expand(2, LENGTH) % 4 == 2
    extra = {"meta_mask": meta_mask} if reads_meta else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # topk / mita warn that their budget exceeds short documents
        packed = layer(x, documents=packed_ids(), **extra)
        (packed.out * weight).sum().backward()
        packed_grads, packed_x_grad = layer_grads(layer), x.grad.clone()
        layer.zero_grad()
        x.grad = None
        for row, start, n in spans():
            piece = slice(start, start + n)
            alone_extra = {"meta_mask": meta_mask[row:row + 1, piece]} if reads_meta else {}
            alone = layer(x[row:row + 1, piece], **alone_extra)
            torch.testing.assert_close(packed.out[row:row + 1, piece], alone.out, atol=2e-6, rtol=1e-5)
            (alone.out * weight[row:row + 1, piece]).sum().backward()
    torch.testing.assert_close(packed_x_grad, x.grad, atol=2e-6, rtol=1e-5)
    alone_grads = layer_grads(layer)
    for key, value in packed_grads.items():
        torch.testing.assert_close(value, alone_grads[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("name", list(list_attentions()))
def test_attention_does_not_cross_a_document_boundary(name):
    layer = make_layer(name, causal=False).eval()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, LENGTH, DIM, generator=gen)
    documents = packed_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = layer(x, documents=documents).out
        changed = x.clone()
        changed[0, :7] = torch.randn(7, DIM, generator=gen) * 3  # the first document of row 0
        out = layer(changed, documents=documents).out
        plain = layer(changed).out
    assert (out[0, 7:] - base[0, 7:]).abs().max() <= 1e-6, f"{name} reads across documents"
    assert torch.equal(out[1], base[1])
    assert not torch.allclose(out[0, :7], base[0, :7])
    assert not torch.allclose(plain[0, 7:], base[0, 7:]), "without documents the change must reach the rest"


@pytest.mark.parametrize("name,train", [("meta", False), ("topk", True)])
def test_packed_aux_loss_is_the_token_weighted_mean_of_the_documents(name, train):
    layer = make_layer(name, causal=True).train(train)
    x = torch.randn(2, LENGTH, DIM, generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = layer(x, documents=packed_ids())
        alone = [(layer(x[row:row + 1, s:s + n]).aux_loss, n) for row, s, n in spans()]
    expected = sum(a * n for a, n in alone) / sum(n for _, n in alone)
    assert float(expected.detach()) != 0.0
    torch.testing.assert_close(packed.aux_loss, expected, atol=1e-6, rtol=1e-5)
    assert float(packed.stats["flops"]) > 0


def test_padding_inside_a_packed_batch_keeps_real_rows():
    layer = make_layer("full", causal=True).eval()
    x = torch.randn(2, LENGTH, DIM, generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[1, 20:] = False  # the end of row 1's last document is padding
    base = layer(x, mask=mask, documents=packed_ids()).out
    noisy = x.clone()
    noisy[1, 20:] = float("nan")
    out = layer(noisy, mask=mask, documents=packed_ids()).out
    torch.testing.assert_close(out[mask], base[mask])
    alone = layer(x[1:, 16:20]).out
    torch.testing.assert_close(base[1:, 16:20], alone, atol=2e-6, rtol=1e-5)


def test_documents_are_validated():
    layer = make_layer("full", causal=True)
    x = torch.randn(1, 6, DIM)
    with pytest.raises(ValueError, match="nondecreasing"):
        layer(x, documents=torch.tensor([[0, 0, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="shape"):
        layer(x, documents=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        layer(x, documents=torch.zeros(1, 6))


def test_layers_that_cannot_pack_name_themselves():
    layer = build_attention("mita", dim=DIM, heads=HEADS, causal=False, grid=(2, 3), landmarks=2, topk=2)
    with pytest.raises(ValueError, match="mita"):
        layer(torch.randn(1, 6, DIM), documents=torch.tensor([[0, 0, 0, 1, 1, 1]]))


def test_cu_seqlens_positions_and_groups():
    documents = documents_from_cu_seqlens([0, 3, 4, 9])
    assert documents.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2, 2]]
    assert cu_seqlens_from_documents(documents).tolist() == [0, 3, 4, 9]
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4]]
    assert documents_from_cu_seqlens([0, 2], length=4).tolist() == [[0, 0, 1, 1]]
    # Rows never share a document, even with equal ids.
    assert cu_seqlens_from_documents(torch.zeros(2, 3, dtype=torch.long)).tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="cu_seqlens"):
        documents_from_cu_seqlens([1, 3])
    # Causal groups: lengths (2^(j-1), 2^j] together, each padded to its longest (<= 2x tokens).
    groups = document_groups(packed_ids(), exact_lengths=False)
    widths = sorted(g.index.shape[1] for g in groups)
    assert widths == [8, 16]  # {5, 7, 8} in (4, 8], {12, 16} in (8, 16]
    assert sum(int(g.inside.sum()) for g in groups) == 2 * LENGTH
    assert sum(g.inside.numel() for g in groups) <= 2 * 2 * LENGTH
    assert len(document_groups(packed_ids(), exact_lengths=True)) == 5


@pytest.mark.parametrize("causal", [True, False])
def test_local_op_with_documents_matches_its_reference(causal):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, LENGTH, 8, generator=gen, requires_grad=True) for _ in range(3))
    documents = packed_ids()
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[0, 3] = False
    fast = local_attention(q, k, v, window=5, causal=causal, mask=mask, documents=documents)
    slow = local_attention_reference(q, k, v, window=5, causal=causal, mask=mask, documents=documents)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(fast.square().sum(), (q, k, v))
    expected = torch.autograd.grad(slow.square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_packed_call_advances_step_counters_once():
    layer = make_layer("meta", causal=True, train_eta=0.5, eta_anneal_steps=10).train()
    x = torch.randn(2, LENGTH, DIM)
    layer(x, documents=packed_ids())
    assert int(layer.routing_step) == 1
    layer(x)
    assert int(layer.routing_step) == 2
