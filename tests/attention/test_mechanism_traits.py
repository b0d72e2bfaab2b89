"""What callers ask of a mechanism is answered by its class: the values below are
what the callers computed from the mechanism's name before the traits moved onto the layers
(compare/budgets.py `options_for` and `LM_ONLY`, models/vit.py `GRID_AWARE`, "full goes first",
bench/generate_bench.py `step_read_bytes`), written down from a run of that code."""

import pytest
import torch

from routeformer.attention import (
    AttentionLayer,
    attention_class,
    baseline_first,
    baseline_name,
    list_attentions,
    register_attention,
    registry,
    with_baseline,
)
from routeformer.compare.budgets import TOPK_KEYS, options_for

LENGTHS = (32, 128, 512, 1024, 4096)
WINDOW = {32: {"window": 8}, 128: {"window": 32}, 512: {"window": 64}, 1024: {"window": 64},
          4096: {"window": 64}}
NONE = {length: {} for length in LENGTHS}
# options_for(mechanism, T) before the change, T in LENGTHS
OLD_OPTIONS = {
    "expanding": NONE,
    "full": NONE,
    "gated": NONE,
    "linear": NONE,
    "local": WINDOW,
    "meta": WINDOW,
    "meta_tokens": NONE,
    "mita": {32: {"landmarks": 4, "topk": 4, "block": 4}, 128: {"landmarks": 16, "topk": 16, "block": 16},
             512: {"landmarks": 8, "topk": 64, "block": 64}, 1024: {"landmarks": 16, "topk": 64, "block": 64},
             4096: {"landmarks": 64, "topk": 64, "block": 64}},
    "multihop": NONE,
    "topk": {32: {"topk": 4}, 128: {"topk": 16}, 512: {"topk": 64}, 1024: {"topk": 64}, 4096: {"topk": 64}},
}
OLD_LM_ONLY = ("meta_tokens",)
OLD_GRID_AWARE = ("mita",)
OLD_CACHED = ("expanding", "full", "gated", "linear", "local", "meta", "meta_tokens", "mita", "multihop",
              "topk")
# step_read_bytes(name, layer, cache) per layer of decode_model(name, context + 8, dim=32, depth=2, heads=2,
# DECODE_OPTIONS) after a prefill of `context` tokens and 3 greedy steps: (bytes, exact)
OLD_READ = {
    ("expanding", 40): (11008, True), ("expanding", 300): (11264, True),
    ("full", 40): (11008, True), ("full", 300): (77568, True),
    ("gated", 40): (11008, True), ("gated", 300): (77568, True),
    ("linear", 40): (2176, True), ("linear", 300): (2176, True),
    ("local", 40): (11008, True), ("local", 300): (65280, True),
    ("meta", 40): (24192, False), ("meta", 300): (145024, False),
    ("meta_tokens", 40): (22059, False), ("meta_tokens", 300): (155439, False),
    ("mita", 40): (16512, False), ("mita", 300): (86408, False),
    ("multihop", 40): (16512, True), ("multihop", 300): (116352, True),
    ("topk", 40): (17536, True), ("topk", 300): (57728, True),
}


def test_every_registered_mechanism_is_covered():
    assert tuple(list_attentions()) == tuple(OLD_OPTIONS) == OLD_CACHED


@pytest.mark.parametrize("name", list(OLD_OPTIONS))
def test_budget_options_are_the_old_options_for(name):
    for length in LENGTHS:
        assert attention_class(name).budget_options(length, TOPK_KEYS) == OLD_OPTIONS[name][length]
        assert options_for(name, length) == OLD_OPTIONS[name][length]


def test_budget_options_follow_the_key_budget():
    assert attention_class("topk").budget_options(4096, 128) == {"topk": 128}
    assert attention_class("local").budget_options(4096, 16) == {"window": 16}
    assert attention_class("mita").budget_options(2048, 128) == {"landmarks": 16, "topk": 128, "block": 128}
    assert attention_class("mita").budget_options(1, 64) == {"landmarks": 1, "topk": 1, "block": 1}


def test_declared_traits_match_the_old_tuples():
    names = list(list_attentions())
    assert tuple(n for n in names if attention_class(n).needs_meta_tokens) == OLD_LM_ONLY
    assert tuple(n for n in names if attention_class(n).grid_aware) == OLD_GRID_AWARE
    assert [n for n in names if attention_class(n).is_baseline] == ["full"] == [baseline_name()]
    # declared per registered class, not inherited: gated derives from full but is not the baseline
    assert issubclass(attention_class("gated"), attention_class("full"))
    assert not attention_class("gated").is_baseline


def test_cached_decoding_matches_the_old_list():
    from routeformer.models.cache import CACHED_MECHANISMS

    assert CACHED_MECHANISMS == OLD_CACHED


@pytest.mark.parametrize("names", [
    ["topk", "full", "local"], ["local", "mita"], ["full"], [], list(OLD_OPTIONS), ["meta", "full", "meta"],
    ["nope", "full"],
])
def test_baseline_first_orders_as_before(names):
    assert baseline_first(names) == sorted(names, key=lambda name: name != "full")
    assert with_baseline(names) == ["full", *[m for m in names if m != "full"]]
    assert with_baseline(iter(names)) == with_baseline(names)


def test_compare_selection_puts_the_baseline_first():
    from routeformer.compare import budgets

    assert budgets.check_selection(None, None)[0] == ["full", "expanding", "gated", "linear", "local", "meta",
                                                      "meta_tokens", "mita", "multihop", "topk"]
    assert budgets.check_selection(None, None, budgets.QUICK)[0] == ["full", "linear", "local", "topk"]


def test_a_second_baseline_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    with pytest.raises(ValueError, match="'full' already is"):
        @register_attention("another-baseline-for-test", baseline=True)
        class Another(AttentionLayer):
            pass


def test_an_unregistered_layer_has_the_defaults():
    assert not AttentionLayer.is_baseline and not AttentionLayer.needs_meta_tokens
    assert not AttentionLayer.grid_aware and AttentionLayer.budget_options(4096, 64) == {}


@pytest.mark.filterwarnings("ignore:topk attention")
@pytest.mark.parametrize("name", OLD_CACHED)
def test_decode_read_bytes_are_the_old_step_read_bytes(name):
    from routeformer.bench.generate_bench import DECODE_OPTIONS, decode_model
    from routeformer.models.cache import DecodeCache

    for context in (40, 300):
        model = decode_model(name, context + 8, 32, 2, 2, DECODE_OPTIONS)
        cache = DecodeCache(reserve=context + 8)
        prompt = torch.randint(2, 256, (1, context), generator=torch.Generator().manual_seed(0))
        prompt[0, ::10] = 1
        with torch.no_grad():
            logits = model(prompt, cache=cache).logits[:, -1]
            for _ in range(3):
                logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
        read = [block.attention.decode_read_bytes(state)
                for block, state in zip(model.backbone.blocks, cache.layers, strict=True)]
        assert read == [OLD_READ[(name, context)]] * 2
