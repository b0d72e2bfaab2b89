"""RouteformerForCausalLM: a transformers model (Auto classes, save/load, exact cached generate)
and `routeformer export-hf` (tiny models from config, no downloads)."""

import json

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from routeformer.cli import main  # noqa: E402
from routeformer.data.vocab import CharVocab  # noqa: E402
from routeformer.integrations.hf import RouteformerConfig, RouteformerForCausalLM  # noqa: E402
from routeformer.integrations.hf.export import VOCAB_NAME  # noqa: E402
from routeformer.models.config import ModelConfig  # noqa: E402
from routeformer.models.heads import CausalLM  # noqa: E402
from routeformer.train import load_config, train  # noqa: E402
from routeformer.train.checkpoint import load_run_model  # noqa: E402

VOCAB = 64
CACHED = {"full": {}, "gated": {}, "local": {"window": 3}, "linear": {"chunk": 4},
          "meta": {"window": 3, "linear_chunk": 4, "position_scale": 16.0},
          "topk": {"topk": 4, "block": 8}, "multihop": {}, "expanding": {"block": 8}}


def build(mechanism, options, positions="rotary", seed=0, tie_embeddings=True):
    torch.manual_seed(seed)
    config = RouteformerConfig(vocab_size=VOCAB, dim=32, depth=2, heads=4, attention=mechanism,
                               attention_options={mechanism: options}, positions=positions, max_seq_len=64,
                               tie_embeddings=tie_embeddings)
    model = RouteformerForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init, so cache mistakes change the argmax
        for parameter in model.parameters():
            parameter.normal_(0, 0.15)
    return model


# Prompts of 24 tokens and 24 new ones: transformers 5.24's drift showed from the 5th new token on,
# and a later drift would pass a short test unseen.
def prompt(batch=2, length=24, seed=1):
    # token 0 is the pad id generate is given: a prompt without it has no inferred padding
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, use_cache, new=24):
    # no_repeat_ngram_size=1: every new token differs from the earlier ones (a random tiny model
    # otherwise settles on one token); the raw logits of every step are compared as well.
    out = model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=use_cache, pad_token_id=0,
                         no_repeat_ngram_size=1,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


def test_config_mirrors_model_config_and_validates():
    config = RouteformerConfig(dim=64, depth=3, heads=2, attention=["local", "full", "linear"])
    assert config.hidden_size == 64 and config.num_hidden_layers == 3 and config.num_attention_heads == 2
    model_config = config.to_model_config()
    assert isinstance(model_config, ModelConfig)
    assert model_config.layer_attention() == ["local", "full", "linear"]
    assert RouteformerConfig.from_model_config(model_config).to_model_config() == model_config
    with pytest.raises(ValueError, match="model.positions"):
        RouteformerConfig(positions="sinusoid")
    with pytest.raises(ValueError, match="causal"):
        RouteformerConfig.from_model_config(ModelConfig(causal=False))


def test_config_defaults_never_drift_from_model_config():
    # RouteformerConfig repeats ModelConfig's fields for transformers; a field or default changed on
    # one side only would make from_pretrained build another model than the one trained
    import dataclasses

    defaults = RouteformerConfig()
    classifier_only = {"causal", "num_classes", "pooling"}  # a causal LM fixes or ignores these
    for f in dataclasses.fields(ModelConfig):
        if f.name in classifier_only:
            continue
        expected = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert getattr(defaults, f.name) == expected, f.name


def test_logits_equal_routeformers_causal_lm():
    model = build("local", CACHED["local"])
    reference = CausalLM(model.config.to_model_config()).eval()
    reference.load_state_dict(model.model.state_dict())
    ids = prompt()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("mechanism", list(CACHED))
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_cached_generate_equals_uncached(mechanism, positions):
    model = build(mechanism, CACHED[mechanism], positions)
    ids = prompt()
    tokens_uncached, logits_uncached = greedy(model, ids, use_cache=False)
    tokens_cached, logits_cached = greedy(model, ids, use_cache=True)
    assert torch.equal(tokens_cached, tokens_uncached)
    torch.testing.assert_close(logits_cached, logits_uncached, atol=2e-5, rtol=1e-4)
    assert len(set(tokens_uncached[0, ids.shape[1]:].tolist())) > 2, "a degenerate stream tests little"


def test_mechanisms_without_a_cache_refuse_cached_generation(monkeypatch):
    # Every registered mechanism has cached decoding now: a layer class told it has none stands in.
    from routeformer.attention.local import LocalAttention

    monkeypatch.setattr(LocalAttention, "supports_cache", False)
    model = build("local", CACHED["local"])
    ids = prompt()
    greedy(model, ids, use_cache=False)
    with pytest.raises(ValueError, match="pass use_cache=False"):
        greedy(model, ids, use_cache=True)


@pytest.mark.parametrize("mechanism", list(CACHED))
def test_a_left_padded_batch_generates_with_the_cache_what_each_prompt_does_alone(mechanism):
    model = build(mechanism, CACHED[mechanism])
    model.generation_config.eos_token_id = None  # a row alone would stop at EOS; the batch pads on
    ids = prompt()
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    attention_mask[1, :7] = 0
    ids = ids.masked_fill(attention_mask == 0, 0)
    with torch.no_grad():
        padded = model(ids, attention_mask=attention_mask, use_cache=True).logits
        alone = model(ids[:1, 3:]).logits
    torch.testing.assert_close(padded[0, 3:], alone[0], atol=1e-5, rtol=1e-4)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=attention_mask, **kwargs)  # cached by default
    for row, pads in enumerate((3, 7)):
        single = model.generate(ids[row:row + 1, pads:], use_cache=False, **kwargs)
        assert torch.equal(batch.sequences[row, ids.shape[1]:], single.sequences[0, ids.shape[1] - pads:])
        torch.testing.assert_close(torch.stack(batch.logits, 1)[row], torch.stack(single.logits, 1)[0],
                                   atol=2e-5, rtol=1e-4)


def test_beam_search_with_the_cache_equals_without():
    model = build("local", CACHED["local"])
    ids = prompt()
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kwargs)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))


def test_loss_is_next_token_loss_plus_aux_loss():
    model = build("meta", CACHED["meta"]).train()
    ids = prompt(length=10)
    output = model(ids, labels=ids)
    logits = output.logits[:, :-1].flatten(0, 1)
    expected = torch.nn.functional.cross_entropy(logits, ids[:, 1:].flatten()) + output.aux_loss
    torch.testing.assert_close(output.loss, expected)
    assert float(output.aux_loss.detach()) != 0.0
    output.loss.backward()
    assert model.model.backbone.blocks[0].attention.router.hidden.weight.grad is not None


@pytest.mark.parametrize("mechanism, tied", [("local", True), ("meta", True), ("full", False)])
def test_save_and_auto_load_give_the_same_logits(tmp_path, mechanism, tied):
    model = build(mechanism, CACHED[mechanism], tie_embeddings=tied)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "routeformer"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, RouteformerForCausalLM)
    tied_after = loaded.model.lm_head.weight is loaded.model.backbone.token_embedding.weight
    assert tied_after == tied
    ids = prompt()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_export_hf_converts_a_training_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = load_config(None, ["--model.dim", "32", "--model.depth", "2", "--model.heads", "2",
                                "--model.attention", "local", "--seq_len", "16", "--batch_size", "4",
                                "--steps", "2", "--warmup_steps", "1", "--eval_every", "2",
                                "--eval_tokens", "256", "--final_eval_tokens", "256",
                                "--out_dir", str(run_dir)])
    train(config, quiet=True)
    out_dir = tmp_path / "hf"
    assert main(["export-hf", str(run_dir), str(out_dir)]) == 0
    assert "wrote" in capsys.readouterr().out
    run = load_run_model(run_dir)
    original, vocab = run.model, run.tokenizer
    exported = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert CharVocab.from_dict(json.loads((out_dir / VOCAB_NAME).read_text())).tokens == vocab.tokens
    ids = vocab.encode("def main():")[None]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, original(ids).logits, atol=0, rtol=0)
    assert main(["export-hf", str(run_dir), str(out_dir)]) == 2  # refuses to overwrite
    assert "not an empty directory" in capsys.readouterr().err
