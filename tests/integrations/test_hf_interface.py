"""attn_implementation="routeformer": transformers models run routeformer's attention through
transformers' AttentionInterface. DeepSeek-V3.2's sparse indices go to the gathered-keys kernel
and give the eager model's logits (whose mask is the same selection); dense models give SDPA's."""

import importlib.util
import inspect

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from routeformer.integrations.hf import register  # noqa: E402
from routeformer.integrations.hf.interface import (  # noqa: E402
    NAME,
    indexed_attention,
    routeformer_attention,
)
from routeformer.ops.backends import recording  # noqa: E402

VOCAB = 97
# find_spec, not hasattr(transformers, ...): a failed lazy lookup replaces sys.modules["transformers"].
needs_deepseek_v32 = pytest.mark.skipif(
    importlib.util.find_spec("transformers.models.deepseek_v32") is None,
    reason=f"DeepSeek-V3.2 (DeepseekV32ForCausalLM) was added in transformers 5.11.0; "
           f"installed {transformers.__version__}")


def padded_mask(ids, pads, side):
    """An attention mask of ones shaped like `ids` with `pads[row]` zeros on `side` ("left" or
    "right") of each listed row."""
    attention_mask = torch.ones_like(ids)
    for row, count in pads.items():
        if side == "left":
            attention_mask[row, :count] = 0
        else:
            attention_mask[row, -count:] = 0
    return attention_mask


def test_the_name_is_registered_with_both_interfaces():
    assert register() == NAME == "routeformer"
    assert AttentionInterface._global_mapping[NAME] is routeformer_attention
    assert NAME in AttentionMaskInterface._global_mapping
    assert NAME in transformers.AttentionInterface()


# -- the indexed path against a dense reference ---------------------------------------------------
def masked_reference(query, key, value, indices, mask, scaling):
    """Dense softmax over the keys that are both selected by `indices` and allowed by `mask`."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    length = key.shape[2]
    selected = torch.zeros(*indices.shape[:2], length + 1, dtype=torch.bool)
    selected.scatter_(-1, indices.long().clamp(-1, length).where(indices < length, length)
                      .where(indices >= 0, length), True)
    allowed = selected[..., :length].unsqueeze(1) & mask
    logits = (query @ key.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, -1).nan_to_num(0.0)
    return weights @ value


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_indexed_attention_equals_the_masked_reference(kv_heads):
    generator = torch.Generator().manual_seed(0)
    batch, heads, length, slots = 2, 4, 23, 6
    query = torch.randn(batch, heads, length, 12, generator=generator)
    key = torch.randn(batch, kv_heads, length, 12, generator=generator)
    value = torch.randn(batch, kv_heads, length, 5, generator=generator)  # v head dim != qk head dim
    indices = torch.stack([torch.randperm(length, generator=generator)[:slots]
                           for _ in range(batch * length)]).view(batch, length, slots).int()
    indices[0, 3, 0], indices[1, 5, 1], indices[1, 7, 2] = -1, length, length + 9  # dropped entries
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = causal.expand(batch, 1, length, length).clone()
    mask[1, :, :, :4] = False  # left padding of row 1
    expected = masked_reference(query, key, value, indices, mask, 0.3)
    with recording() as chosen:
        out = indexed_attention(query, key, value, indices, mask, 0.3)
    assert chosen["routed_attention"] in ("native", "torch", "triton")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the additive float form of the same mask and the plain-causal None mask
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    torch.testing.assert_close(indexed_attention(query, key, value, indices, additive, 0.3), expected,
                               atol=1e-5, rtol=1e-5)
    causal_only = masked_reference(query, key, value, indices, causal.expand(batch, 1, -1, -1), 0.3)
    torch.testing.assert_close(indexed_attention(query, key, value, indices, None, 0.3), causal_only,
                               atol=1e-5, rtol=1e-5)


def test_indexed_attention_refuses_what_it_cannot_honour():
    query, key = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    indices = torch.zeros(1, 4, 2, dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="dropout"):
        routeformer_attention(module, query, key, key, None, dropout=0.1, indices=indices)
    with pytest.raises(ValueError, match="softcap=30.0"):
        routeformer_attention(module, query, key, key, None, indices=indices, softcap=30.0)
    with pytest.raises(ValueError, match="sliding_window=2"):
        routeformer_attention(module, query, key, key, None, indices=indices, sliding_window=2)
    with pytest.raises(ValueError, match=r"indices must be \[B, S, K\]"):
        indexed_attention(query, key, key, indices[0], None)
    with pytest.raises(ValueError, match="score bias"):
        indexed_attention(query, key, key, indices, torch.full((1, 1, 4, 4), 0.5))


# -- DeepSeek-V3.2 --------------------------------------------------------------------------------
def deepseek_v32(implementation, index_topk=8):
    config = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=index_topk, index_head_dim=16, index_n_heads=2,
        first_k_dense_replace=1, max_position_embeddings=4096, pad_token_id=0,
        attn_implementation=implementation)
    torch.manual_seed(0)
    return transformers.DeepseekV32ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def deepseek_pair():
    eager, routed = deepseek_v32("eager"), deepseek_v32("routeformer")
    routed.load_state_dict(eager.state_dict())
    assert routed.config._attn_implementation == NAME
    return eager, routed


@needs_deepseek_v32
@pytest.mark.parametrize("length", [1, 17, 300, 2048])
def test_deepseek_v32_logits_equal_eager(deepseek_pair, length):
    eager, routed = deepseek_pair
    ids = torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = eager(ids).logits
        with recording() as chosen:
            logits = routed(ids).logits
    assert "routed_attention" in chosen  # the indices went to the gathered-keys op
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@needs_deepseek_v32
def test_deepseek_v32_selection_matters_at_this_length(deepseek_pair):
    # The equality above is not dense attention in disguise: sdpa without the index mask differs.
    eager, _ = deepseek_pair
    ids = torch.randint(1, VOCAB, (1, 64), generator=torch.Generator().manual_seed(3))
    dense = deepseek_v32("sdpa")
    dense.load_state_dict(eager.state_dict())
    with torch.no_grad():
        assert torch.allclose(dense(ids).logits, eager(ids).logits, atol=1e-4)  # sdpa applies the mask too
        logits = eager(ids).logits
        for module in eager.modules():  # every key selected: plain causal attention
            if hasattr(module, "index_topk"):
                module.index_topk = 64
        unselected = eager(ids).logits
        for module in eager.modules():
            if hasattr(module, "index_topk"):
                module.index_topk = 8
    assert (logits - unselected).abs().max() > 1e-2


@needs_deepseek_v32
@pytest.mark.parametrize("side", ["left", "right"])
def test_deepseek_v32_padded_batch_equals_eager(deepseek_pair, side):
    eager, routed = deepseek_pair
    ids = torch.randint(1, VOCAB, (3, 41), generator=torch.Generator().manual_seed(5))
    pads = {1: 13, 2: 30}  # row 2 keeps fewer tokens than index_topk
    attention_mask = padded_mask(ids, pads, side)
    with torch.no_grad():
        expected = eager(ids, attention_mask=attention_mask).logits
        logits = routed(ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()  # padded positions' outputs are not defined by either
    torch.testing.assert_close(logits[real], expected[real], atol=1e-4, rtol=1e-4)


@needs_deepseek_v32
def test_deepseek_v32_cached_generation_equals_uncached(deepseek_pair):
    eager, routed = deepseek_pair
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :5] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    cached = routed.generate(ids, use_cache=True, **kwargs)
    assert torch.equal(cached, routed.generate(ids, use_cache=False, **kwargs))
    assert torch.equal(cached, eager.generate(ids, use_cache=True, **kwargs))
    # step by step with the cache: each step's logits equal the eager model's cached steps (a full
    # forward is not the reference: the indexer's ReLU scores tie, and top-k breaks ties by length)
    # the cache argument's name: `cache` from transformers 5.24, `past_key_values` before
    name = "cache" if "cache" in inspect.signature(routed.forward).parameters else "past_key_values"

    def steps(model):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            logits = [model(ids[:1, :12], use_cache=True, **{name: cache}).logits]
            for position in range(12, 20):
                logits.append(model(ids[:1, position:position + 1], use_cache=True, **{name: cache}).logits)
        assert cache.get_seq_length() == 20
        return torch.cat(logits, 1)

    with recording() as chosen:
        routed_steps = steps(routed)
    assert "routed_attention" in chosen
    torch.testing.assert_close(routed_steps, steps(eager), atol=1e-4, rtol=1e-4)


# -- dense models ---------------------------------------------------------------------------------
def llama(implementation):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, attn_implementation=implementation)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(implementation):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     attn_implementation=implementation)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("family", [llama, gpt2])
def test_dense_models_equal_sdpa(family):
    sdpa, routed = family("sdpa"), family("routeformer")
    assert routed.config._attn_implementation == NAME
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :7] = 0
    calls = []
    original = AttentionInterface._global_mapping[NAME]
    AttentionInterface._global_mapping[NAME] = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with torch.no_grad():
            for mask in (None, attention_mask):
                expected = sdpa(ids, attention_mask=mask).logits
                torch.testing.assert_close(routed(ids, attention_mask=mask).logits, expected,
                                           atol=1e-5, rtol=1e-5)
    finally:
        AttentionInterface._global_mapping[NAME] = original
    assert len(calls) == 2 * 2  # both layers, both calls went through the registered function
