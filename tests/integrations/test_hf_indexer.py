"""patch_indexer: DeepSeek-V3.2's indexer scored in query blocks over each block's readable keys
returns transformers' own indices (ties included), so a patched model's logits, padded batches and
cached decoding are the unpatched model's."""

import functools
import importlib.util
import inspect

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from routeformer.integrations.hf import patch_indexer  # noqa: E402
from routeformer.integrations.hf.indexer import (  # noqa: E402
    BLOCK_ATTRIBUTE,
    _largest,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
)
from tests.integrations.test_hf_interface import (  # noqa: E402
    VOCAB,
    needs_deepseek_v32,  # skips below transformers 5.11 (no DeepSeek-V3.2), under the tested range
    padded_mask,
)


def assert_same_selection(indices, expected, scores):
    """Tie-aware first (the chosen keys' scores, in order, are the expected keys'), then exact."""
    assert indices.shape == expected.shape and indices.dtype == torch.int32
    chosen, wanted = scores.gather(-1, indices.long()), scores.gather(-1, expected.long())
    assert torch.equal(chosen, wanted)
    assert torch.equal(indices, expected)  # ties too: the same keys in the same order


# -- the op against transformers' dense expression ------------------------------------------------
def inputs(batch, queries, keys, heads, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, queries, heads, dim, generator=generator)
    k = torch.randn(batch, keys, dim, generator=generator)
    weights = torch.randn(batch, queries, heads, generator=generator)
    k[:, 7::11] = k[:, 3:4]  # duplicated keys: exact score ties that are not zeros
    positions = torch.arange(keys - queries, keys)  # the queries are the last ones (a cache before)
    causal = torch.arange(keys).view(1, -1) <= positions.view(-1, 1)
    return q, k, weights, causal.expand(batch, queries, keys).clone()


MIN = torch.finfo(torch.float32).min


def as_float(mask, blocked=MIN):
    return torch.zeros(mask.shape).masked_fill(~mask, blocked)


CASES = {  # batch, queries, keys, heads, dim, topk, block
    "prefill": (2, 300, 300, 2, 16, 8, 37),
    "one block": (1, 60, 60, 4, 8, 8, 128),
    "block of one": (1, 40, 40, 2, 8, 4, 1),
    "after a cache": (2, 50, 180, 2, 16, 8, 16),
    "decode step": (3, 1, 90, 2, 8, 8, 128),
    "topk over the keys": (2, 33, 33, 2, 16, 64, 5),
    "one head": (1, 200, 200, 1, 16, 6, 64),
    "long rows": (1, 1100, 1100, 2, 16, 16, 128),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mask_kind", ["bool", "float", "-inf"])
def test_indices_equal_transformers(case, mask_kind):
    batch, queries, keys, heads, dim, topk, block = CASES[case]
    q, k, weights, mask = inputs(batch, queries, keys, heads, dim)
    if batch > 1:
        mask[1, :, :9] = False  # row 1 left-padded
        mask[-1, :, keys - 4:] = False  # the last row right-padded
    if mask_kind != "bool":
        mask = as_float(mask, MIN if mask_kind == "float" else float("-inf"))
    expected = indexer_topk_reference(q, k, weights, mask, topk, 0.25)
    scores = indexer_scores_reference(q, k, weights, mask, 0.25)
    assert_same_selection(indexer_topk(q, k, weights, mask, topk, 0.25, block), expected, scores)


def test_ties_are_common_here():
    # the equality above covers ties: many queries have tied scores among their top k + 1
    q, k, weights, mask = inputs(*CASES["prefill"][:5])
    top = indexer_scores_reference(q, k, weights, mask, 0.25).topk(9, dim=-1).values
    tied = (top[..., 1:] == top[..., :-1]).any(-1)
    assert tied.float().mean() > 0.2


def test_a_shared_mask_and_unfilled_keys():
    # a [1, S, T] mask for the whole batch; keys past the last query unreadable (a static cache's
    # unfilled slots), so no block scores them
    q, k, weights, mask = inputs(3, 20, 120, 2, 16)
    mask = mask[:1].clone()
    mask[..., 100:] = False
    mask[..., :20] = mask[..., 20:40]
    for kind in (mask, as_float(mask)):
        expected = indexer_topk_reference(q, k, weights, kind, 8, 0.5)
        scores = indexer_scores_reference(q, k, weights, kind, 0.5)
        assert_same_selection(indexer_topk(q, k, weights, kind, 8, 0.5, 6), expected, scores)


def test_half_precision_inputs_are_scored_in_fp32():
    q, k, weights, mask = inputs(2, 64, 64, 2, 16)
    q, k = q.bfloat16(), k.bfloat16()
    expected = indexer_topk_reference(q, k, weights, mask, 8, 0.25)
    scores = indexer_scores_reference(q, k, weights, mask, 0.25)
    assert_same_selection(indexer_topk(q, k, weights, mask, 8, 0.25, 16), expected, scores)


def test_empty_inputs():
    q, k, weights, mask = inputs(2, 5, 5, 2, 8)
    assert indexer_topk(q[:, :0], k, weights[:, :0], mask[:, :0], 4, 0.25).shape == (2, 0, 4)
    assert indexer_topk(q, k[:, :0], weights, mask[..., :0], 4, 0.25).shape == (2, 5, 0)


@pytest.mark.parametrize("length, count", [(4096, 65), (1000, 9), (300, 9), (50, 9)])
def test_largest_equals_topk_where_values_are_distinct(length, count):
    generator = torch.Generator().manual_seed(length)
    values = torch.randn(3, 7, length, generator=generator)
    values[0, 0, 10:] = float("-inf")  # a row with only 10 finite values
    top, where = _largest(values, count)
    expected = values.topk(count, dim=-1)
    assert torch.equal(top, expected.values)
    distinct = torch.ones(3, 7, dtype=torch.bool)
    distinct[0, 0] = False
    assert torch.equal(where[distinct], expected.indices[distinct])


def test_bad_arguments_raise():
    q, k, weights, mask = inputs(1, 6, 6, 2, 8)
    with pytest.raises(ValueError, match="block must be a positive int"):
        indexer_topk(q, k, weights, mask, 4, 0.25, 0)
    with pytest.raises(ValueError, match="topk must be a positive int"):
        indexer_topk(q, k, weights, mask, 0, 0.25)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B or 1, S, T\]"):
        indexer_topk(q, k, weights, mask[:, :, :5], 4, 0.25)
    with pytest.raises(ValueError, match=r"weights must be \[B, S, H\]"):
        indexer_topk(q, k, weights[..., :1], mask, 4, 0.25)
    with pytest.raises(ValueError, match=r"q must be \[B, S, H, D\]"):
        indexer_topk(q[0], k, weights, mask, 4, 0.25)


# -- a DeepSeek-V3.2 model ------------------------------------------------------------------------
def deepseek_v32(implementation, index_topk=8, index_n_heads=2):
    config = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=index_topk, index_head_dim=16,
        index_n_heads=index_n_heads, first_k_dense_replace=1, max_position_embeddings=4096, pad_token_id=0,
        attn_implementation=implementation)
    torch.manual_seed(0)
    return transformers.DeepseekV32ForCausalLM(config).eval()


def indexers(model):
    return [module for module in model.modules() if hasattr(module, "index_topk")]


@pytest.fixture(scope="module")
def models():
    """The eager model, and the eager (float mask) and routeformer (bool mask) models with the
    blocked indexer, all with the same weights."""
    eager = deepseek_v32("eager")
    patched = {name: deepseek_v32(name) for name in ("eager", "routeformer")}
    for model in patched.values():
        model.load_state_dict(eager.state_dict())
        assert patch_indexer(model, block=32) is model
    return eager, patched


def forward(model, ids, **kwargs):
    """Logits and every indexer's indices [layers, B, S, topk] of one forward."""
    found = []
    hooks = [module.register_forward_hook(lambda module, args, out: found.append(out))
             for module in indexers(model)]
    try:
        with torch.no_grad():
            logits = model(ids, **kwargs).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack(found)


@needs_deepseek_v32
@pytest.mark.parametrize("length", [1, 17, 300, 1100])
def test_patched_models_give_eager_indices_and_logits(models, length):
    eager, patched = models
    ids = torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    expected_logits, expected = forward(eager, ids)
    for name, model in patched.items():
        logits, indices = forward(model, ids)
        assert torch.equal(indices, expected), name
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


@needs_deepseek_v32
def test_the_blocked_forward_runs_and_the_state_is_unchanged(models):
    eager, patched = models
    for model in patched.values():
        assert all(getattr(module, BLOCK_ATTRIBUTE) == 32 for module in indexers(model))
        assert all("forward" in vars(module) for module in indexers(model))
        assert model.state_dict().keys() == eager.state_dict().keys()
    calls = []
    module = indexers(patched["eager"])[0]
    original = module.forward
    module.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        forward(patched["eager"], torch.randint(1, VOCAB, (1, 9)))
    finally:
        module.forward = original
    assert calls == [1]


@needs_deepseek_v32
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_eager(models, side):
    eager, patched = models
    ids = torch.randint(1, VOCAB, (3, 70), generator=torch.Generator().manual_seed(5))
    attention_mask = padded_mask(ids, {1: 13, 2: 64}, side)  # row 2 keeps fewer tokens than index_topk
    expected_logits, expected = forward(eager, ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    for name, model in patched.items():
        logits, indices = forward(model, ids, attention_mask=attention_mask)
        assert torch.equal(indices, expected), name
        torch.testing.assert_close(logits[real], expected_logits[real], atol=1e-4, rtol=1e-4)


@needs_deepseek_v32
def test_prefill_and_cached_decode_equal_eager(models):
    eager, patched = models
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :5] = 0
    # the cache argument's name: `cache` from transformers 5.24, `past_key_values` before
    name = "cache" if "cache" in inspect.signature(eager.forward).parameters else "past_key_values"

    def steps(model):
        cache = transformers.DynamicCache(config=model.config)
        logits = [forward(model, ids[:, :25], attention_mask=attention_mask[:, :25], use_cache=True,
                          **{name: cache})]
        for position in range(25, 40):
            logits.append(forward(model, ids[:, position:position + 1], use_cache=True,
                                  attention_mask=attention_mask[:, :position + 1], **{name: cache}))
        assert cache.get_seq_length() == 40
        return logits

    expected = steps(eager)
    real = attention_mask[:, :25].bool()  # padded positions' outputs are not defined by either
    for model in patched.values():
        for step, (got, wanted) in enumerate(zip(steps(model), expected, strict=True)):
            (logits, indices), (want_logits, want) = got, wanted
            assert torch.equal(indices, want)
            if step == 0:
                logits, want_logits = logits[real], want_logits[real]
            torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    assert torch.equal(patched["routeformer"].generate(ids, use_cache=True, **kwargs),
                       eager.generate(ids, use_cache=True, **kwargs))


@needs_deepseek_v32
def test_patch_indexer_sets_a_new_block_and_refuses_bad_input():
    model = deepseek_v32("routeformer")
    patch_indexer(model)
    patch_indexer(model, block=5)
    assert {getattr(module, BLOCK_ATTRIBUTE) for module in indexers(model)} == {5}
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        patch_indexer("model")
    for block in (0, True, 2.0):
        with pytest.raises(ValueError, match="block must be a positive int"):
            patch_indexer(model, block=block)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="has no DeepSeek-V3.2 indexer"):
        patch_indexer(llama)


@needs_deepseek_v32
def test_an_indexer_that_computes_something_else_is_refused(monkeypatch):
    model = deepseek_v32("routeformer")
    indexer_class = type(indexers(model)[0])
    original = indexer_class.forward

    @functools.wraps(original)  # the same arguments, other indices: the smallest scores first
    def reversed_order(self, *args, **kwargs):
        return original(self, *args, **kwargs).flip(-1)

    monkeypatch.setattr(indexer_class, "forward", reversed_order)
    with pytest.raises(ValueError, match="picks other keys than the blocked one"):
        patch_indexer(model)
    assert not any("forward" in vars(module) for module in indexers(model))  # left unchanged


def test_without_deepseek_v32_patch_indexer_says_so(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.endswith("deepseek_v32") else real(name, *args))
    with pytest.raises(ValueError, match=r"has no DeepSeek-V3.2 \(DeepseekV32Indexer was added"):
        patch_indexer(torch.nn.Linear(2, 2))
