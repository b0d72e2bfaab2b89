"""Invariants every registered attention layer keeps — new mechanisms are picked up automatically."""

import pytest
import torch

from routeformer.attention import AttentionOutput, build_attention, list_attentions

# The same small options as the invariants (windows/chunks/blocks crossed by short sequences).
from tests.attention.test_invariants import DIM, GROUPED_VARIANTS, HEADS, SMALL_OPTIONS  # noqa: E402

# Every mechanism, and the grouped-query builds (kv_heads < heads) of those that take them.
CASES = list(list_attentions()) + list(GROUPED_VARIANTS)


def make_layer(name, causal, seed=0, **extra):
    name, variant_options, _ = GROUPED_VARIANTS.get(name, (name, {}, None))
    torch.manual_seed(seed)
    options = {**SMALL_OPTIONS.get(name, {}), **variant_options, **extra}
    return build_attention(name, dim=DIM, heads=HEADS, causal=causal, **options).eval()


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("rotary", [False, True])
def test_causal_layers_never_see_the_future(name, rotary):
    layer = make_layer(name, causal=True, rotary=rotary)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 23, DIM, generator=gen)
    base = layer(x).out
    for t in (1, 6, 11, 22):
        perturbed = x.clone()
        perturbed[:, t:] = torch.randn(2, 23 - t, DIM, generator=gen) * 3
        out = layer(perturbed).out
        assert (out[:, :t] - base[:, :t]).abs().max() <= 1e-6, f"{name} leaks from t >= {t}"
        assert not torch.allclose(out[:, t:], base[:, t:]), "the perturbation must matter"


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_padded_tokens_do_not_change_real_outputs(name, causal):
    layer = make_layer(name, causal=causal)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 17, DIM, generator=gen)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, 12:] = False
    base = layer(x, mask=mask)
    noisy = x.clone()
    noisy[1, 12:] = torch.randn(5, DIM, generator=gen) * 10
    out = layer(noisy, mask=mask)
    torch.testing.assert_close(out.out[mask], base.out[mask], atol=1e-5, rtol=1e-5)
    # The unpadded sequence of the batch gives what it gives alone.
    alone = layer(x[:1])
    torch.testing.assert_close(base.out[0], alone.out[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_output_contract_and_gradients(name):
    layer = make_layer(name, causal=True).train()
    x = torch.randn(2, 9, DIM, requires_grad=True)
    # Layers that read meta-tokens get some, so their meta-attention's parameters are used too.
    reads_meta = getattr(layer, "reads_meta_mask", False)
    extra = {"meta_mask": torch.arange(9).expand(2, 9) % 3 == 1} if reads_meta else {}
    result = layer(x, **extra)
    assert isinstance(result, AttentionOutput)
    assert result.out.shape == x.shape and result.aux_loss.shape == ()
    assert result.stats["flops"].item() > 0
    assert all(not value.requires_grad for value in result.stats.values())
    (result.out.square().mean() + result.aux_loss).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for param_name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, param_name


@pytest.mark.parametrize("name", CASES)
def test_bad_inputs_raise_value_errors(name):
    layer = make_layer(name, causal=True)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(2, 5, DIM + 1))
    with pytest.raises(ValueError, match="mask must be a bool"):
        layer(torch.randn(2, 5, DIM), mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="positions must be"):
        layer(torch.randn(2, 5, DIM), positions=torch.zeros(2, 4, dtype=torch.long))
