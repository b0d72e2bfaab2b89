"""transformers integration on small models built from config (no downloads)."""

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from routeformer.integrations.hf import (  # noqa: E402
    key_padding_mask,
    patch_attention,
    routeformer_aux_loss,
    routeformer_layers,
)

MECHANISMS = {
    "full": {}, "gated": {}, "local": {"window": 4}, "linear": {"chunk": 4},
    "meta": {"window": 4, "linear_chunk": 4}, "mita": {"landmarks": 4, "topk": 4},
    "topk": {"topk": 4, "block": 8}, "multihop": {}, "expanding": {"block": 8},
}
VOCAB, LENGTH = 50, 16


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama():
    # Grouped-query attention (2 K/V heads for 4 query heads) and the default rotary embedding.
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init, so a wrong rotation or head order shows
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    return model


FAMILIES = {"gpt2": gpt2, "llama": llama}


def tokens(seed=0, batch=2):
    return torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_reproduces_the_original_logits(family):
    original = FAMILIES[family]()
    ids = tokens()
    with torch.no_grad():
        expected = original(ids).logits
        patched = patch_attention(original, "full")
        assert len(routeformer_layers(patched)) == 2
        torch.testing.assert_close(patched(ids).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_with_left_padding_matches_the_original(family):
    original = FAMILIES[family]()
    ids = tokens()
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :5] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        expected = original(ids, attention_mask=attention_mask, position_ids=position_ids).logits
        got = patch_attention(original, "full")(ids, attention_mask=attention_mask,
                                                 position_ids=position_ids).logits
    torch.testing.assert_close(got[0, 5:], expected[0, 5:], atol=1e-5, rtol=1e-4)  # the real tokens
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_patched_model_trains_generates_and_stays_causal(family, mechanism):
    model = patch_attention(FAMILIES[family](), mechanism, **MECHANISMS[mechanism])
    ids = tokens()
    model.train()
    output = model(ids, labels=ids)
    loss = output.loss + routeformer_aux_loss(model)
    loss.backward()
    layer = routeformer_layers(model)[0].layer
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad and p.dim() == 2)
    model.eval()
    with torch.no_grad():
        base = model(ids).logits
        perturbed = ids.clone()
        perturbed[:, 10:] = (perturbed[:, 10:] + 7) % VOCAB
        changed = model(perturbed).logits
    torch.testing.assert_close(changed[:, :10], base[:, :10], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(changed[:, 10:], base[:, 10:])
    generated = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 9) and torch.equal(generated[:, :4], ids[:, :4])


def test_meta_keeps_pretrained_weights_in_every_expert():
    original = gpt2()
    expected = original.transformer.h[0].attn.c_attn.weight.t().clone()
    layer = routeformer_layers(patch_attention(original, "meta"))[0].layer
    for projection in layer.expert_qkv:
        assert torch.equal(projection.weight, expected)


def test_key_padding_mask_from_transformers_masks():
    additive = torch.zeros(1, 1, 4, 4)
    additive[..., 0] = torch.finfo(torch.float32).min  # key 0 padded
    assert key_padding_mask(additive, 1, 4).tolist() == [[False, True, True, True]]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    assert key_padding_mask(causal, 1, 4) is None  # every key is read by its own query
    with pytest.raises(ValueError, match="attention_mask must be"):
        key_padding_mask(torch.ones(1, 1, 4), 1, 4)


def test_unsupported_models_and_options_are_rejected():
    with pytest.raises(ValueError, match="no GPT-2 or Llama-style attention"):
        patch_attention(_Bare(), "full")
    with pytest.raises(ValueError, match="unknown"):
        patch_attention(gpt2(), "nope")


class _Bare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = transformers.GPT2Config()
        self.body = torch.nn.Linear(2, 2)
