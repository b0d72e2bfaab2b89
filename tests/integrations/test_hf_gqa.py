"""A grouped-query Llama (8 query heads, 2 K/V heads) patched with routeformer's `full`: the layers
take kv_heads = 2 and k_proj/v_proj as they are, so the patched model computes the original's
logits with the original's parameters and decode-cache bytes (no repeated K/V)."""

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from routeformer.attention.base import key_value_bytes  # noqa: E402
from routeformer.attention.full import FullAttention  # noqa: E402
from routeformer.integrations.hf import patch_attention, routeformer_layers  # noqa: E402
from routeformer.ops.decode import state_bytes  # noqa: E402

VOCAB, HEADS, KV_HEADS = 40, 8, 2


def grouped_llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init, so a wrong head order shows
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    return model


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_grouped_llama_patched_with_full_keeps_logits_parameters_and_cache_bytes():
    model = grouped_llama()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    step = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(2))
    parameters = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        expected = model(ids).logits
        original = model(ids, use_cache=True)
        original_step = model(step, past_key_values=original.past_key_values, use_cache=True)
        original_bytes = tensor_bytes(t for layer in original_step.past_key_values.layers
                                      for t in (layer.keys, layer.values))
        patch_attention(model, "full")
        layers = routeformer_layers(model)
        assert [(m.layer.heads, m.layer.kv_heads) for m in layers] == [(HEADS, KV_HEADS)] * 2
        assert sum(p.numel() for p in model.parameters()) == parameters
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=0)
        prefill = model(ids, use_cache=True)
        # After the prompt, the cache's storage is the prompt's K/V of 2 heads: the original's bytes.
        prompt_storage = sum(state_bytes(layer.state) for layer in prefill.past_key_values.layers)
        assert prompt_storage * 13 == original_bytes * 12
        patched_step = model(step, past_key_values=prefill.past_key_values, use_cache=True)
        torch.testing.assert_close(patched_step.logits, original_step.logits, atol=1e-5, rtol=0)
        live = sum(key_value_bytes(layer.state) for layer in patched_step.past_key_values.layers)
    assert live == original_bytes


def test_patch_takes_kv_heads_from_the_model():
    with pytest.raises(ValueError, match="kv_heads=4: patch_attention takes the K/V heads from the model"):
        patch_attention(grouped_llama(), "full", kv_heads=4)


def test_a_mechanism_without_a_grouped_form_gets_the_key_value_heads_repeated(monkeypatch):
    monkeypatch.setattr(FullAttention, "reads_grouped_kv", False)  # as a mechanism without kv_heads
    model = grouped_llama()
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        patch_attention(model, "full")
        layer = routeformer_layers(model)[0].layer
        assert layer.kv_heads == HEADS
        assert layer.qkv_proj.weight.shape[0] == 3 * HEADS * layer.head_dim
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=0)
