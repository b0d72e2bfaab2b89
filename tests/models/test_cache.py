"""Cached decoding: token-by-token logits equal the parallel forward pass's (the invariant)."""

import pytest
import torch

from routeformer.models.cache import DecodeCache
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM

VOCAB, PAUSE, LENGTH = 23, 3, 14

CACHED = {
    "full": ("full", {}),
    "gated": ("gated", {}),
    "local": ("local", {"window": 4}),
    "linear": ("linear", {"chunk": 4}),
    "meta_soft": ("meta", {"window": 4, "linear_chunk": 4, "position_scale": 16.0}),
    "meta_hard": ("meta", {"window": 4, "linear_chunk": 4, "eval_eta": 0.3, "position_scale": 16.0}),
    "meta_shared_qkv": ("meta", {"window": 3, "share_qkv": True, "eval_eta": 0.3, "position_scale": 16.0}),
    "meta_tokens": ("meta_tokens", {}),
    "meta_tokens_gated_separate": ("meta_tokens", {"combine": "gated", "meta_projections": "separate"}),
    "topk": ("topk", {"topk": 3}),
    "topk_window_global_gathered": ("topk", {"topk": 2, "local_window": 2, "global_tokens": 2,
                                             "dense_below": 0}),
    "topk_shared_score_bias": ("topk", {"topk": 3, "shared_routing": True, "routing_learning": "score_bias",
                                        "routing_positions": "rotary", "dense_below": 0}),
    "multihop": ("multihop", {}),
    "multihop_three_identity": ("multihop", {"hops": 3, "identity": True}),
    "expanding": ("expanding", {"prior_alpha": 1.0, "prior_beta": 4.0}),
    "expanding_mean_field": ("expanding", {"update": "mean_field", "prior_alpha": 2.0, "prior_beta": 3.0}),
    # Grouped-query attention: one K/V head for the model's two query heads.
    "full_kv1": ("full", {"kv_heads": 1}),
    "gated_kv1": ("gated", {"kv_heads": 1}),
    "local_kv1": ("local", {"window": 4, "kv_heads": 1}),
    "linear_kv1": ("linear", {"chunk": 4, "kv_heads": 1}),
    "topk_kv1_gathered": ("topk", {"topk": 2, "local_window": 2, "dense_below": 0, "kv_heads": 1}),
    "topk_kv1_per_group": ("topk", {"topk": 3, "kv_heads": 1, "route_per": "group", "dense_below": 0}),
    "meta_tokens_kv1": ("meta_tokens", {"kv_heads": 1}),
    "meta_hard_kv1": ("meta", {"window": 4, "linear_chunk": 4, "eval_eta": 0.3, "position_scale": 16.0,
                               "kv_heads": 1}),
    "meta_shared_qkv_kv1": ("meta", {"window": 3, "share_qkv": True, "eval_eta": 0.3, "position_scale": 16.0,
                                     "kv_heads": 1}),
    "meta_tokens_parallel_kv1": ("meta_tokens", {"meta_input": "parallel", "combine": "gated",
                                                 "kv_heads": 1}),
    "multihop_three_kv1": ("multihop", {"hops": 3, "identity": True, "kv_heads": 1}),
    "expanding_kv1": ("expanding", {"prior_alpha": 1.0, "prior_beta": 4.0, "kv_heads": 1}),
}


def build(mechanism: str, options: dict, positions: str = "rotary", **extra) -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, dim=32, depth=2, heads=2, attention=mechanism,
                         attention_options={mechanism: options}, positions=positions, max_seq_len=32, **extra)
    model = CausalLM(config).eval()
    for parameter in model.parameters():  # larger weights than the init, so differences show
        parameter.data.normal_(0, 0.3)
    return model


def stream(seed: int = 1) -> torch.Tensor:
    tokens = torch.randint(4, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(seed))
    tokens[0, [2, 5, 6, 11]] = PAUSE  # meta-tokens at different places in the two sequences
    tokens[1, [0, 9]] = PAUSE
    return tokens


def decode_in_pieces(model: CausalLM, tokens: torch.Tensor, pieces: list[int]) -> torch.Tensor:
    cache, logits, start = DecodeCache(), [], 0
    for size in pieces:
        logits.append(model(tokens[:, start:start + size], cache=cache).logits)
        start += size
    assert cache.length == tokens.shape[1]
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("name", list(CACHED))
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_cached_decoding_matches_parallel(name, positions):
    mechanism, options = CACHED[name]
    extra = {"meta_token_id": PAUSE} if mechanism == "meta_tokens" else {}
    model = build(mechanism, options, positions, **extra)
    tokens = stream()
    with torch.no_grad():
        parallel = model(tokens).logits
        one_by_one = decode_in_pieces(model, tokens, [1] * LENGTH)
        prefill_then_steps = decode_in_pieces(model, tokens, [6, 3, 1, 1, 1, 2])
    torch.testing.assert_close(one_by_one, parallel, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(prefill_then_steps, parallel, atol=2e-5, rtol=1e-4)


def test_meta_hard_routing_is_exercised():
    # The hard case above must mix hard and soft tokens, or it tests nothing beyond soft routing.
    model = build("meta", CACHED["meta_hard"][1])
    with torch.no_grad():
        fractions = [float(s["hard_fraction"]) for s in model.backbone(stream()).stats]
    assert any(0.0 < f < 1.0 for f in fractions), fractions


def test_meta_tokens_cache_with_zeroed_positions():
    model = build("meta_tokens", {}, "rotary", meta_token_id=PAUSE, zero_meta_positions_eval=True)
    tokens = stream()
    with torch.no_grad():
        torch.testing.assert_close(decode_in_pieces(model, tokens, [1] * LENGTH), model(tokens).logits,
                                   atol=2e-5, rtol=1e-4)


def test_meta_tokens_cache_reads_meta_keys():
    # The meta path is really read in the cache: changing only the meta projections changes the
    # output from the first meta-token on (sequence 0: index 2), and nothing before it.
    model = build("meta_tokens", {"meta_projections": "separate"}, meta_token_id=PAUSE)
    tokens = stream()
    with torch.no_grad():
        base = decode_in_pieces(model, tokens, [1] * LENGTH)
        model.backbone.blocks[0].attention.meta_qkv_proj.weight.data.mul_(2.0)
        changed = decode_in_pieces(model, tokens, [1] * LENGTH)
    assert torch.equal(base[0, :2], changed[0, :2])
    assert not torch.allclose(base[0, 2], changed[0, 2])


@pytest.mark.parametrize("name", ["full", "local", "linear", "meta_soft", "meta_tokens"])
def test_generate_with_and_without_cache_agree(name):
    mechanism, options = CACHED[name]
    extra = {"meta_token_id": PAUSE} if mechanism == "meta_tokens" else {}
    model = build(mechanism, options, **extra)
    prompt = stream()[:, :5]
    cached = model.generate(prompt, 8, temperature=0, use_cache=True)
    reread = model.generate(prompt, 8, temperature=0, use_cache=False)
    assert torch.equal(cached, reread)
    generator_a, generator_b = (torch.Generator().manual_seed(4) for _ in range(2))
    sampled = model.generate(prompt, 8, temperature=1.0, generator=generator_a)
    assert torch.equal(sampled, model.generate(prompt, 8, temperature=1.0, generator=generator_b,
                                               use_cache=False))


def test_local_cache_keeps_only_the_window():
    model = build("local", {"window": 4})
    cache = DecodeCache()
    with torch.no_grad():
        model(stream(), cache=cache)
    assert all(layer["k"].shape[2] == 3 and layer["start"] == LENGTH - 3 for layer in cache.layers)


def test_cache_errors(monkeypatch):
    from routeformer.attention.topk import TopKAttention

    model = build("topk", {"topk": 4})
    monkeypatch.setattr(TopKAttention, "supports_cache", False)  # a mechanism without a cached form
    with pytest.raises(ValueError, match="no cached decoding"):
        model(stream(), cache=DecodeCache())
    with pytest.raises(ValueError, match="use_cache=True"):
        model.generate(stream()[:, :3], 2, use_cache=True)
    assert model.generate(stream()[:, :3], 2).shape == (2, 5)  # falls back to re-reading
    monkeypatch.undo()
    exploring = build("topk", {"topk": 4, "exploration": 0.5}).train()
    with pytest.raises(ValueError, match="exploration"):
        exploring(stream(), cache=DecodeCache())
    meta = build("meta", {"window": 4, "position_scale": None})  # the paper's length-dependent feature
    with pytest.raises(ValueError, match="position_scale"):
        meta(stream(), cache=DecodeCache())
    learned = build("full", {}, "learned")
    with pytest.raises(ValueError, match="max_seq_len"):
        learned.generate(stream()[:, :30 - LENGTH + 20], 20, use_cache=True)
    # A padding mask is taken with the first call (each row then keeps its own state:
    # tests/models/test_padded_generate.py); padding that starts after an unpadded prompt is refused.
    cache = DecodeCache()
    learned(stream(), cache=cache, mask=torch.ones(2, LENGTH, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding after an unpadded start"):
        learned(stream()[:, :1], cache=cache, mask=torch.tensor([[True], [False]]))


def test_generation_bench_reports_both_paths():
    from routeformer.bench.generate_bench import bench_generation, format_row

    rows = bench_generation(["full", "linear"], contexts=(12,), new_tokens=3, repeats=1,
                            progress=lambda _: None)
    assert [(r["mechanism"], r["context"]) for r in rows] == [("full", 12), ("linear", 12)]
    for row in rows:
        assert row["same_tokens"] and row["cached_tokens_per_s"] > 0 and row["reread_tokens_per_s"] > 0
        assert format_row(row).startswith(f"| {row['mechanism']} | 12 | 3 |")
