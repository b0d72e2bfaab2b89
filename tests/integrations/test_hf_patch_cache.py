"""Patched transformers models: cached generation exact or refused, attention the swap cannot
reproduce refused, mode/dtype kept, save/load keeps the mechanism (tiny models, no downloads)."""

import json
import subprocess
import sys

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from routeformer.integrations.hf import patch_attention, routeformer_layers  # noqa: E402
from routeformer.integrations.hf.loading import from_pretrained  # noqa: E402
from routeformer.integrations.hf.patch import PATCHED_MODEL_TYPE  # noqa: E402
from tests.integrations.test_hf import MECHANISMS, VOCAB, gpt2, llama  # noqa: E402

FAMILIES = {"gpt2": gpt2, "llama": llama}
# meta_tokens without meta-tokens in the input (a patched model has no meta_mask): plain attention
# whose meta-token parameters stay unused, so it is only in this file's generation test.
MECHANISMS = MECHANISMS | {"meta_tokens": {}}
# Every registered mechanism decodes with a cache (topk, multihop and expanding since their cached
# decoding); the refusal path is tested with a layer class told it has none.
CACHED = tuple(MECHANISMS)


# Prompts of 24 tokens and 24 new ones: transformers 5.24's drift showed from the 5th new token on,
# and a later drift would pass a short test unseen.
def prompt(batch=2, length=24, seed=3):
    # token 0 is the pad id generate is given: a prompt without it has no inferred padding
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, use_cache, new=24):
    # no_repeat_ngram_size=1 keeps a random tiny model from repeating one token; raw logits compared too.
    out = model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=use_cache, pad_token_id=0,
                         no_repeat_ngram_size=1, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_cached_generation_is_exact_or_refused(family, mechanism):
    model = patch_attention(FAMILIES[family](), mechanism, **MECHANISMS[mechanism])
    ids = prompt()
    tokens, logits = greedy(model, ids, use_cache=False)
    cached_tokens, cached_logits = greedy(model, ids, use_cache=True)
    assert torch.equal(cached_tokens, tokens)
    torch.testing.assert_close(cached_logits, logits, atol=2e-5, rtol=1e-4)
    assert model.config.use_cache  # default generation takes the cache


def test_a_mechanism_without_cached_decoding_refuses_the_cache(monkeypatch):
    from routeformer.attention.local import LocalAttention

    monkeypatch.setattr(LocalAttention, "supports_cache", False)
    model = patch_attention(gpt2(), "local", window=4)
    ids = prompt()
    tokens, _ = greedy(model, ids, use_cache=False)
    with pytest.raises(ValueError, match="local.*pass use_cache=False"):
        greedy(model, ids, use_cache=True)
    assert not model.config.use_cache  # default generation re-reads the context
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0,
                                      no_repeat_ngram_size=1), tokens)


def test_local_cache_keeps_only_the_window():
    model = patch_attention(gpt2(), "local", window=4)
    output = model(prompt(length=12), use_cache=True)
    layer = output.past_key_values.layers[0]
    assert layer.get_seq_length() == 12 and layer.state["k"].shape[2] <= 4


def test_a_cache_filled_in_training_cannot_continue():
    model = patch_attention(llama(), "full")
    ids = prompt()
    output = model.train()(ids, use_cache=True)
    model.eval()
    with pytest.raises(ValueError, match="training mode.*pass use_cache=False"):
        model(ids[:, :1], past_key_values=output.past_key_values, use_cache=True)


def left_padded(lengths=(24, 30, 27), seed=5, side="left"):
    """A left- (or right-) padded batch (pad id 0) of prompts of different lengths, its mask and
    the prompts. (transformers' own positions, e.g. GPT-2's learned ones, follow the layout, so
    only left padding gives each row its positions alone; CausalLM.generate takes both sides.)"""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[index, where], mask[index, where] = row, 1
    return ids, mask, rows


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mechanism", CACHED)
def test_a_left_padded_batch_generates_with_the_cache_what_each_prompt_does_alone(family, mechanism):
    model = patch_attention(FAMILIES[family](), mechanism, **MECHANISMS[mechanism])
    model.generation_config.eos_token_id = None  # a row alone would stop at EOS; the batch pads on
    ids, mask, rows = left_padded()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=mask, use_cache=True, **kwargs)
    for index, row in enumerate(rows):
        alone = model.generate(row[None], use_cache=False, **kwargs)
        assert torch.equal(batch.sequences[index, ids.shape[1]:], alone.sequences[0, len(row):]), index
        torch.testing.assert_close(torch.stack(batch.logits, 1)[index], torch.stack(alone.logits, 1)[0],
                                   atol=2e-5, rtol=1e-4)


def mistral(sliding_window):
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, sliding_window=sliding_window)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


def qwen2(use_sliding_window):
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, use_sliding_window=use_sliding_window,
                                      sliding_window=4, max_window_layers=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


def gemma2(**overrides):
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    config = transformers.Gemma2Config(**(values | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("build, feature", [
    (lambda: mistral(4), "sliding-window attention"),
    (lambda: qwen2(True), "sliding-window attention"),
    (lambda: gemma2(), "sliding-window attention"),
    (lambda: gemma2(sliding_window=None), "soft-capping"),
    (lambda: gemma2(sliding_window=None, attn_logit_softcapping=None, query_pre_attn_scalar=16),
     "attention scale"),
], ids=["mistral-window", "qwen2-window", "gemma2", "gemma2-softcap", "gemma2-scale"])
def test_attention_the_swap_cannot_reproduce_is_refused_untouched(build, feature):
    model = build()
    before = {name: type(module) for name, module in model.named_modules()}
    with pytest.raises(ValueError, match=feature):
        patch_attention(model, "full")
    assert {name: type(module) for name, module in model.named_modules()} == before


@pytest.mark.parametrize("build", [lambda: mistral(None), lambda: qwen2(False)], ids=["mistral", "qwen2"])
def test_plain_causal_variants_are_carried_exactly(build):
    model = build()
    ids = prompt(length=12)
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(patch_attention(model, "full")(ids).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("training", [False, True])
def test_patch_keeps_mode_and_dtype(training):
    model = gpt2().to(torch.bfloat16).train(training)
    patch_attention(model, "meta", window=4, linear_chunk=4)
    for module in routeformer_layers(model):
        assert module.training == training and module.layer.training == training
        assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    if not training:  # Meta-Attention's routing noise is off in eval mode: two passes agree
        ids = prompt()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_and_from_pretrained_keep_the_mechanism(tmp_path, family):
    model = patch_attention(FAMILIES[family](), "local", window=3)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == PATCHED_MODEL_TYPE
    assert saved["routeformer"] == {"mechanism": "local", "options": {"window": 3},
                                    "base_model_type": family}
    ids = prompt(length=10)
    # the loader, and the Auto classes once routeformer.integrations.hf is imported
    for loaded in (from_pretrained(tmp_path), transformers.AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert type(loaded) is type(model)
        assert not loaded.training and routeformer_layers(loaded)[0].layer.window == 3
        assert loaded.config.routeformer == {"mechanism": "local", "options": {"window": 3}}
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    loaded.save_pretrained(tmp_path / "again")  # a reloaded model saves as it was saved
    assert json.loads((tmp_path / "again" / "config.json").read_text())["routeformer"] == saved["routeformer"]


def test_without_routeformer_the_auto_classes_refuse_a_patched_model_and_name_the_loader(tmp_path):
    patch_attention(gpt2(), "local", window=3).save_pretrained(tmp_path)
    load = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "routeformer" not in sys.modules.get("__main__").__name__
    assert "ValueError" in done.stderr and "routeformer.integrations.hf.from_pretrained" in done.stderr


def test_a_directory_saved_with_the_base_model_type_still_loads(tmp_path):
    # config.json written before the patched model_type: the base model's type and a routeformer entry
    model = patch_attention(gpt2(), "local", window=3)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["model_type"] = saved["routeformer"].pop("base_model_type")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    ids = prompt(length=10)
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path)(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_the_auto_classes_refuse_what_a_patched_model_cannot_take(tmp_path):
    patch_attention(gpt2(), "local", window=3).save_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"unsupported config overrides \['attn_implementation'\]"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    with pytest.raises(TypeError, match=r"unsupported arguments \['made_up'\]"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, made_up=1)
    with pytest.raises(TypeError, match="device_map: a patched routeformer model loads on one device"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_from_pretrained_refuses_an_unpatched_model(tmp_path):
    gpt2().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no 'routeformer' entry"):
        from_pretrained(tmp_path)
