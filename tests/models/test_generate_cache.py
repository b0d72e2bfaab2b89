"""CausalLM.generate with and without the cache, for every registered mechanism; the cache's
buffers grow without copying."""

import pytest
import torch

from routeformer.attention import build_attention, list_attentions
from routeformer.models.cache import CACHED_MECHANISMS, DecodeCache, cached_mechanisms
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.ops.decode import append_keys_values, state_bytes, trim_keys_values

VOCAB, PROMPT, NEW = 29, 24, 24
# Options small enough that each mechanism's decode does its own work at 48 tokens (K < context,
# windows shorter than the stream, a few meta-tokens).
OPTIONS = {
    "local": {"window": 6},
    "linear": {"chunk": 8},
    "meta": {"window": 6, "linear_chunk": 8, "eval_eta": 0.3, "position_scale": 64.0},
    "mita": {"landmarks": 2, "topk": 4, "route": 1, "block": 8},
    "topk": {"topk": 4, "local_window": 2, "global_tokens": 1, "dense_below": 0},
    "expanding": {"prior_alpha": 1.0, "prior_beta": 4.0},
}
PAUSE = 3


def build(mechanism: str) -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, dim=32, depth=2, heads=2, attention=mechanism,
                         attention_options={mechanism: OPTIONS.get(mechanism, {})}, positions="rotary",
                         max_seq_len=PROMPT + NEW,
                         meta_token_id=PAUSE if mechanism == "meta_tokens" else None)
    model = CausalLM(config).eval()
    for parameter in model.parameters():  # larger weights than the init, so differences show
        parameter.data.normal_(0, 0.3)
    return model


def test_every_registered_mechanism_has_a_cache():
    # Derived from the layers (supports_cache), not a hand-kept list.
    assert set(CACHED_MECHANISMS) == set(list_attentions()) == set(cached_mechanisms())


@pytest.mark.parametrize("mechanism", sorted(list_attentions()))
def test_generate_with_cache_equals_without(mechanism):
    model = build(mechanism)
    prompt = torch.randint(4, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    prompt[0, [3, 10, 17]] = PAUSE
    # Greedy: an untrained model with tied embeddings soon repeats one token, so the contexts differ
    # only in length; sampling (the same generator seed on both paths) feeds varied tokens.
    for temperature in (0.0, 1.0):
        runs = [model.generate(prompt, NEW, temperature=temperature, use_cache=use_cache, output_logits=True,
                               generator=torch.Generator().manual_seed(7))
                for use_cache in (True, False)]
        (cached, cached_logits), (reread, reread_logits) = runs
        assert cached_logits.shape == (2, NEW, VOCAB)
        torch.testing.assert_close(cached_logits, reread_logits, atol=2e-5, rtol=1e-4)
        assert torch.equal(cached, reread)
        # every step's logits are its own (the cache is read, not one row repeated)
        assert not torch.allclose(cached_logits[:, 1:], cached_logits[:, :-1])
    assert len(set(cached[:, PROMPT:].flatten().tolist())) > 5  # the sampled run's tokens vary


def test_keys_values_grow_in_place():
    cache = {"reserve": 6}
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    k_all, v_all, start = append_keys_values(cache, k, v)
    buffer = cache["k_buffer"]
    assert buffer.shape[2] == 6 and start == 0 and torch.equal(k_all, k) and torch.equal(v_all, v)
    pointer = buffer.data_ptr()
    steps = [torch.randn(2, 3, 1, 5) for _ in range(2)]
    for step in steps:
        k_all, _, _ = append_keys_values(cache, step, step)
        assert cache["k_buffer"].data_ptr() == pointer  # within capacity: no reallocation
        assert k_all.data_ptr() == pointer  # the returned keys are a view of the buffer
    assert torch.equal(k_all, torch.cat([k, *steps], dim=2))
    append_keys_values(cache, steps[0], steps[0])  # 7 > 6: doubles
    assert cache["k_buffer"].shape[2] == 12 and cache["k_buffer"].data_ptr() != pointer
    grown = cache["k_buffer"].data_ptr()
    for _ in range(5):
        append_keys_values(cache, steps[1], steps[1])
    assert cache["k_buffer"].data_ptr() == grown and cache["k"].shape[2] == 12
    assert torch.equal(cache["k"], torch.cat([k, *steps, steps[0], *[steps[1]] * 5], dim=2))


def test_window_cache_compacts_instead_of_growing():
    cache, keep = {}, 3
    stream = torch.randn(1, 2, 40, 4)
    append_keys_values(cache, stream[:, :, :keep], stream[:, :, :keep], capacity=8)
    pointer = cache["k_buffer"].data_ptr()
    for index in range(keep, 40):
        token = stream[:, :, index:index + 1]
        k_all, _, start = append_keys_values(cache, token, token)
        assert start == index - keep and torch.equal(k_all, stream[:, :, index - keep:index + 1])
        trim_keys_values(cache, keep)
        assert cache["k_buffer"].data_ptr() == pointer and cache["k_buffer"].shape[2] == 8


def test_generate_allocates_the_stream_once():
    # generate announces prompt + new tokens: full's buffers are never reallocated while decoding.
    model = build("full")
    prompt = torch.randint(4, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    cache = DecodeCache(reserve=PROMPT + 4)
    with torch.no_grad():
        model(prompt, cache=cache)
        pointers = [layer["k_buffer"].data_ptr() for layer in cache.layers]
        for token in range(4):
            model(prompt[:, token:token + 1], cache=cache)
    assert [layer["k_buffer"].data_ptr() for layer in cache.layers] == pointers
    assert all(layer["k_buffer"].shape[2] == PROMPT + 4 for layer in cache.layers)
    # State size counts each allocation once (the views share their buffer's storage).
    per_layer = 2 * 1 * 2 * (PROMPT + 4) * 16 * 4  # k and v, B=1, H=2, capacity, d=16, fp32
    assert state_bytes(cache.layers) == 2 * per_layer


@pytest.mark.parametrize("mechanism", ["full", "local", "topk", "multihop", "expanding"])
def test_batch_reorder_of_a_cache_state(mechanism):
    # Beam search / batch selection map every tensor of a layer's state along dim 0 (as
    # integrations/hf/cache.py does); decoding then continues as for the reordered batch.
    layer = build_attention(mechanism, dim=16, heads=2, causal=True, **OPTIONS.get(mechanism, {})).eval()
    x = torch.randn(3, 20, 16)
    order = torch.tensor([2, 0, 2])
    positions = torch.arange(20).expand(3, 20)
    with torch.no_grad():
        cache = {"reserve": 20}
        layer.decode(x[:, :12], positions=positions[:, :12], cache=cache)
        cache = {key: value.index_select(0, order) if isinstance(value, torch.Tensor) and value.dim()
                 else value for key, value in cache.items()}
        steps = [layer.decode(x[order, index:index + 1], positions=positions[:, index:index + 1], cache=cache)
                 for index in range(12, 20)]
        expected = layer(x[order]).out[:, 12:]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=2e-5, rtol=1e-4)
