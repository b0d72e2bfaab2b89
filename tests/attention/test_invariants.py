"""Off-the-happy-path invariants of docs/design.md, run on every registered mechanism.

Each test is parametrised over `list_attentions()`, so a mechanism is checked the day it is
registered. The properties:

- prefix invariance of causal builds: `layer(x[:, :t]).out == layer(x).out[:, :t]` — the output
  of the first t tokens depends neither on what follows nor on the total length;
- padding: with a key-padding mask, padded rows may hold anything (NaN included) and the real rows
  equal the layer run on the real tokens alone (right and left padding; causal and bidirectional);
- edge shapes: T = 0 and B = 0 give empty outputs of the right shape; T = 1 works;
  non-contiguous inputs give the contiguous result;
- low precision: bf16 and fp16 forward + backward are finite and within `LOW_PRECISION_RTOL` of
  fp32 (relative error of the output, ‖out − out_fp32‖ / ‖out_fp32‖), on CPU and, when present, CUDA.
"""

from __future__ import annotations

import pytest
import torch

from routeformer.attention import attention_class, build_attention, list_attentions

DIM, HEADS = 32, 4
# Small windows/chunks/blocks so that short sequences cross block and chunk boundaries.
SMALL_OPTIONS = {
    "local": {"window": 5},
    "linear": {"chunk": 4},
    "topk": {"topk": 3, "block": 4, "local_window": 1, "dense_below": 0},
    "expanding": {"block": 4, "prior_beta": 3.0},
    "meta": {"window": 5, "linear_chunk": 4, "full_chunk": 4},
    "mita": {"landmarks": 3, "topk": 4, "block": 4},
}
NAMES = list(list_attentions())


def _spread_meta_routing(layer) -> None:
    """Larger controller weights, so hard-routed tokens go to all three experts (the routed-rows
    paths of every expert run, not only the prior's favourite)."""
    torch.nn.init.normal_(layer.router.increments.weight, std=1.0)


# Builds beyond each mechanism's defaults whose code paths differ: name -> (mechanism, options,
# a function preparing the built layer).
VARIANTS = {"meta_hard": ("meta", {"eval_eta": 0.0}, _spread_meta_routing)}
# Grouped-query builds (kv_heads = 1 and heads / 2) of every mechanism that takes kv_heads < heads.
GROUPED_VARIANTS = {f"{name}_kv{kv_heads}": (name, {"kv_heads": kv_heads}, None)
                    for name in NAMES if attention_class(name).reads_grouped_kv
                    for kv_heads in (1, HEADS // 2)}
VARIANTS.update(GROUPED_VARIANTS)
CASES = NAMES + list(VARIANTS)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Relative error of the output against the fp32 layer with the same weights. bf16 keeps 8
# mantissa bits (unit roundoff 2^-8 ≈ 4e-3) and fp16 11 (≈ 5e-4); a layer rounds its input, its
# projections and its attention weights, so a few unit roundoffs is what an fp32-accumulating op
# reaches. Routing decisions (top-k, expert argmax) may flip on near ties, which the margin allows
# for only where a tie is rare at these sizes.
LOW_PRECISION_RTOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}

# Mechanisms whose routing is a hard choice per token (MiTA's top-r experts, topk's top-K keys):
# in low precision a near-tied choice may flip, which moves that one token's output by O(1) while
# every other token stays within the tolerance. For them the criterion is per token: the median
# token within the tolerance, and at most 10% of the tokens beyond it (measured: mita 2-5 of 120
# tokens flip; topk, routing in fp32 from bf16-rounded x and weights, 1-7 of 120 over 4 seeds,
# median token error 5e-3).
PER_TOKEN_CRITERION = {"mita", "topk"}


def make_layer(name: str, causal: bool, seed: int = 0, **extra):
    """The mechanism (or VARIANTS entry) `name` with small options, in eval mode."""
    mechanism, variant_options, prepare = VARIANTS.get(name, (name, {}, None))
    torch.manual_seed(seed)
    options = {**SMALL_OPTIONS.get(mechanism, {}), **variant_options, **extra}
    layer = build_attention(mechanism, dim=DIM, heads=HEADS, causal=causal, **options)
    if prepare is not None:
        prepare(layer)
    return layer.eval()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


# -- prefix (streaming) invariance ---------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_causal_prefix_is_independent_of_total_length(name):
    layer = make_layer(name, causal=True, rotary=True)
    x = torch.randn(2, 29, DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = layer(x).out
        for t in (1, 4, 9, 16, 28):
            prefix = layer(x[:, :t]).out
            torch.testing.assert_close(prefix, whole[:, :t], atol=2e-5, rtol=1e-5,
                                       msg=lambda m, t=t: f"{name}: prefix of {t} tokens differs\n{m}")


# -- padding ----------------------------------------------------------------------------------------
def _padded_batch(side: str, fill: float) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    """x [3, 19, D] whose sequences hold 19, 13 and 6 real tokens, padded on `side` with `fill`;
    the mask; and each sequence's slice of real positions."""
    gen = torch.Generator().manual_seed(4)
    length, real_lengths = 19, (19, 13, 6)
    x = torch.randn(len(real_lengths), length, DIM, generator=gen)
    mask = torch.zeros(len(real_lengths), length, dtype=torch.bool)
    spans = []
    for b, real in enumerate(real_lengths):
        span = slice(0, real) if side == "right" else slice(length - real, length)
        mask[b, span] = True
        spans.append(span)
    x = x.masked_fill(~mask[..., None], fill)
    return x, mask, spans


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("fill", [float("nan"), 1e4], ids=["nan", "huge"])
def test_padding_leaves_real_rows_as_if_alone(name, causal, side, fill):
    """Real rows equal the layer run on the real tokens alone, whatever the padded rows hold.
    Positions count real tokens only (the usual convention for left padding)."""
    layer = make_layer(name, causal=causal, rotary=True)
    x, mask, spans = _padded_batch(side, fill)
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        out = layer(x, mask=mask, positions=positions).out
        for b, span in enumerate(spans):
            alone = layer(x[b : b + 1, span]).out[0]
            assert torch.isfinite(out[b, span]).all(), f"{name}: padded rows leak non-finite values"
            torch.testing.assert_close(out[b, span], alone, atol=2e-5, rtol=1e-5,
                                       msg=lambda m, b=b: f"{name}: sequence {b} moved\n{m}")


@pytest.mark.parametrize("name", CASES)
def test_padding_gradients_are_finite_and_skip_padded_rows(name):
    """Training on a NaN-padded batch: finite gradients, none reaching padded inputs."""
    layer = make_layer(name, causal=True).train()
    x, mask, _ = _padded_batch("right", float("nan"))
    x.requires_grad_(True)
    result = layer(x, mask=mask)
    loss = result.out[mask].square().mean() + result.aux_loss
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(x.grad).all() and x.grad[~mask].abs().max() == 0
    for param_name, param in layer.named_parameters():
        if param.grad is not None:
            assert torch.isfinite(param.grad).all(), f"{name}: {param_name} has a non-finite gradient"


# -- edge shapes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("shape", [(2, 0), (0, 7), (0, 0)], ids=["T0", "B0", "B0T0"])
def test_empty_inputs_give_empty_outputs(name, causal, shape):
    layer = make_layer(name, causal=causal).train()
    x = torch.randn(*shape, DIM, requires_grad=True)
    mask = torch.ones(shape, dtype=torch.bool)
    for call_mask in (None, mask):
        result = layer(x, mask=call_mask)
        assert result.out.shape == (*shape, DIM)
        assert result.aux_loss.shape == () and torch.isfinite(result.aux_loss)
        (result.out.sum() + result.aux_loss).backward()  # training on an empty batch does not crash
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_single_token(name, causal):
    layer = make_layer(name, causal=causal)
    x = torch.randn(3, 1, DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = layer(x).out
        assert out.shape == x.shape and torch.isfinite(out).all()
        # One token reads only itself: the batch rows are independent.
        torch.testing.assert_close(out[1:2], layer(x[1:2]).out, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_non_contiguous_inputs(name, causal):
    layer = make_layer(name, causal=causal, rotary=True)
    gen = torch.Generator().manual_seed(6)
    storage = torch.randn(DIM, 2, 21, generator=gen)  # x [B, T, D] as a transposed view
    x = storage.permute(1, 2, 0)
    assert not x.is_contiguous()
    mask = torch.ones(21, 2, dtype=torch.bool)
    mask[15:, 1] = False
    mask = mask.t()  # a non-contiguous mask too
    positions = torch.arange(21).expand(2, 21)  # a stride-0 view
    with torch.no_grad():
        for call_mask in (None, mask):
            out = layer(x, mask=call_mask, positions=positions).out
            expected = layer(x.contiguous(), mask=None if call_mask is None else call_mask.contiguous(),
                             positions=positions.contiguous()).out
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


# -- low precision --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_forward_backward(name, causal, dtype, device):
    """Forward and backward in bf16/fp16 (training mode, a padded batch) are finite, and the
    evaluation output is within LOW_PRECISION_RTOL of the fp32 layer with the same weights."""
    reference = make_layer(name, causal=causal).to(device)
    layer = make_layer(name, causal=causal).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 70, DIM, generator=gen).to(device)  # crosses 64-token kernel chunks
    mask = torch.ones(2, 70, dtype=torch.bool, device=device)
    mask[1, 50:] = False
    with torch.no_grad():
        expected = reference(x, mask=mask).out
        actual = layer(x.to(dtype), mask=mask).out
    assert actual.dtype == dtype and torch.isfinite(actual).all()
    tolerance = LOW_PRECISION_RTOL[dtype]
    if VARIANTS.get(name, (name,))[0] in PER_TOKEN_CRITERION:
        per_token = ((actual[mask].float() - expected[mask]).norm(dim=-1) / expected[mask].norm(dim=-1))
        flipped = float((per_token > tolerance).float().mean())
        assert float(per_token.median()) <= tolerance and flipped <= 0.1, (
            f"{name} {dtype}: median token error {float(per_token.median()):.2e}, {flipped:.0%} beyond")
    else:
        error = relative_error(actual[mask], expected[mask])
        assert error <= tolerance, f"{name} {dtype}: relative error {error:.2e}"

    layer.train()
    x_low = x.to(dtype).requires_grad_(True)
    result = layer(x_low, mask=mask)
    assert result.out.dtype == dtype
    (result.out[mask].float().square().mean() + result.aux_loss.float()).backward()
    assert torch.isfinite(x_low.grad).all(), f"{name} {dtype}: non-finite input gradient"
    for param_name, param in layer.named_parameters():
        if param.grad is not None:
            assert torch.isfinite(param.grad).all(), f"{name} {dtype}: {param_name} gradient not finite"


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_padding_mask_is_never_a_dense_square_mask(name, causal, monkeypatch):
    """A key-padding mask costs O(T) memory: no SDPA call receives a mask with ≥ T²/2 entries per
    sequence (the dense [B, 1, T, T] form padding used to take). A smoke test, not a bound on every
    allocation."""
    import torch.nn.functional as F

    largest = [0]
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        if attn_mask is not None:
            largest[0] = max(largest[0], attn_mask.numel())
        return real_sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    layer = make_layer(name, causal=causal)
    batch, length = 2, 96
    x = torch.randn(batch, length, DIM, generator=torch.Generator().manual_seed(8))
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 70:] = False
    mask[0, :9] = False
    with torch.no_grad():
        layer(x, mask=mask)
    assert largest[0] < batch * length * length / 2, f"{name}: an SDPA mask of {largest[0]} entries"
