import json

import pytest
import torch
import torch.nn.functional as F

from routeformer.attention import list_attentions
from routeformer.models import CausalLM, ModelConfig, SequenceClassifier

SMALL = dict(vocab_size=50, dim=32, depth=2, heads=4, max_seq_len=64,
             attention_options={"local": {"window": 4}, "linear": {"chunk": 8}})


@pytest.mark.parametrize("mechanism", list(list_attentions()))
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal_lm_logits_never_depend_on_later_tokens(mechanism, positions):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SMALL, attention=mechanism, positions=positions)).eval()
    tokens = torch.randint(0, 50, (2, 30))
    base = model(tokens).logits
    changed = tokens.clone()
    changed[:, 17:] = torch.randint(0, 50, (2, 13))
    logits = model(changed).logits
    assert (logits[:, :17] - base[:, :17]).abs().max() <= 1e-5
    assert not torch.allclose(logits[:, 17:], base[:, 17:])


def test_loss_ignores_minus_100_and_aux_is_separate():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SMALL, attention=["local", "full"]))
    tokens = torch.randint(0, 50, (2, 12))
    labels = torch.randint(0, 50, (2, 12))
    labels[0, :5] = -100
    out = model(tokens, labels)
    keep = labels != -100
    expected = F.cross_entropy(out.logits[keep], labels[keep])
    torch.testing.assert_close(out.loss, expected)
    assert out.aux_loss.item() == 0.0 and len(out.stats) == 2
    torch.testing.assert_close(out.total_loss, out.loss + out.aux_loss)


def test_embeddings_are_tied_unless_asked_otherwise():
    tied = CausalLM(ModelConfig(**SMALL))
    assert tied.lm_head.weight is tied.backbone.token_embedding.weight
    untied = CausalLM(ModelConfig(**SMALL, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.backbone.token_embedding.weight


def test_config_round_trips_through_json():
    config = ModelConfig(**SMALL, attention=["local", "gated"], positions="learned")
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config


@pytest.mark.parametrize(
    "values, message",
    [
        ({"attention": ["full"]}, "lists 1 mechanisms but model.depth is 2"),
        ({"positions": "sinusoid"}, "model.positions must be one of"),
        ({"dim": 0}, "model.dim must be a positive integer"),
        ({"dropout": 1.5}, "model.dropout must be in"),
    ],
)
def test_bad_config_raises(values, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SMALL, **values})


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match="unknown model config key.*'widht'"):
        ModelConfig.from_dict({"widht": 3})


def test_learned_positions_beyond_max_seq_len_raise():
    model = CausalLM(ModelConfig(**SMALL, positions="learned"))
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_classifier_pooling_ignores_padding(pooling):
    torch.manual_seed(0)
    config = ModelConfig(**SMALL, causal=pooling == "last", pooling=pooling, num_classes=3)
    model = SequenceClassifier(config).eval()
    tokens = torch.randint(0, 50, (1, 10))
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 7:] = False
    padded = model(tokens, mask=mask).logits
    other_padding = tokens.clone()
    other_padding[0, 7:] = 0
    torch.testing.assert_close(padded, model(other_padding, mask=mask).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, model(tokens[:, :7]).logits, atol=1e-5, rtol=1e-5)
    out = model(tokens, torch.tensor([2]), mask=mask)
    assert out.logits.shape == (1, 3) and out.loss.item() > 0


def test_cls_pooling_in_a_causal_model_is_refused():
    with pytest.raises(ValueError, match="pooling='cls'"):
        SequenceClassifier(ModelConfig(**SMALL, pooling="cls"))


def test_generate_is_reproducible_and_greedy_matches_argmax():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SMALL))
    prompt = torch.randint(0, 50, (1, 5))
    first = model.generate(prompt, 8, generator=torch.Generator().manual_seed(3))
    second = model.generate(prompt, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, second) and first.shape == (1, 13)
    greedy = model.generate(prompt, 1, temperature=0)
    assert greedy[0, -1] == model(prompt).logits[0, -1].argmax()
