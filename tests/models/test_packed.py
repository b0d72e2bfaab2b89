"""Packed sequences at model level: a CausalLM's loss on a packed row is its documents' loss."""

from __future__ import annotations

import warnings

import pytest
import torch

from routeformer.models import CausalLM, ModelConfig
from tests.attention.test_invariants import SMALL_OPTIONS

LENGTHS = [9, 14, 5]  # one row of 28 tokens


def lm_pieces(tokens: torch.Tensor):
    """Each document's own next-token labels; its last token has none (-100)."""
    labels = torch.cat([tokens[1:], torch.tensor([-100])])
    return tokens, labels


@pytest.mark.parametrize("mechanism", ["full", "local", "linear", "topk", "mita", "meta", "meta_tokens"])
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal_lm_loss_on_a_packed_row_equals_the_documents_losses(mechanism, positions):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=40, dim=32, depth=2, heads=4, max_seq_len=64, attention=mechanism,
                         positions=positions, attention_options={mechanism: SMALL_OPTIONS.get(mechanism, {})})
    model = CausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, 40, (n,), generator=gen) for n in LENGTHS]
    pieces = [lm_pieces(d) for d in documents]
    tokens = torch.cat([p[0] for p in pieces])[None]
    labels = torch.cat([p[1] for p in pieces])[None]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # topk / mita: budgets larger than short documents
        packed = model(tokens, labels, documents=ids)
        packed.loss.backward()
        packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        total_nll, count, start = 0.0, 0, 0
        for (doc_tokens, doc_labels), n in zip(pieces, LENGTHS, strict=True):
            alone = model(doc_tokens[None], doc_labels[None])
            torch.testing.assert_close(packed.logits[:, start:start + n], alone.logits, atol=1e-5, rtol=1e-4)
            total_nll = total_nll + alone.loss * (n - 1)
            count += n - 1
            start += n
    combined = total_nll / count
    torch.testing.assert_close(packed.loss, combined, atol=1e-6, rtol=1e-5)
    combined.backward()
    for name, param in model.named_parameters():
        if name in packed_grads:
            torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)
    # Without document ids the same row is one long sequence: a different loss.
    assert not torch.allclose(model(tokens, labels).loss, packed.loss)


def test_packed_documents_refuse_cached_decoding_and_bad_ids():
    from routeformer.models.cache import DecodeCache

    model = CausalLM(ModelConfig(vocab_size=40, dim=32, depth=1, heads=4, max_seq_len=64))
    tokens = torch.randint(0, 40, (1, 6))
    with pytest.raises(ValueError, match="cached"):
        model(tokens, documents=torch.zeros(1, 6, dtype=torch.long), cache=DecodeCache())
    with pytest.raises(ValueError, match="nondecreasing"):
        model(tokens, documents=torch.tensor([[1, 1, 0, 0, 2, 2]]))
