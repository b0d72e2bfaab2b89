"""mita_attention against mita_reference, its limiting identities, causality, streaming (prefix
invariance), padding, low precision, edge shapes and its errors."""

import pytest
import torch
import torch.nn.functional as F

from routeformer.ops.mita import (
    grid_pool_shape,
    landmark_attention,
    landmark_attention_reference,
    mita_attention,
    mita_reference,
)
from routeformer.ops.mita import landmarks as mita_landmarks

BLOCK = 4  # causal block length in these tests: 23 tokens make 6 blocks, 5 landmarks


def qkv(batch=2, heads=3, length=23, dim=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=gen, dtype=dtype).requires_grad_()
            for _ in range(3)]


def padding_mask(batch, length, pad=5, side="right"):
    """The last row loses `pad` tokens on `side` ("scattered": every third token from the second)."""
    mask = torch.ones(batch, length, dtype=torch.bool)
    if side == "right":
        mask[-1, length - pad:] = False
    elif side == "left":
        mask[-1, :pad] = False
    else:
        mask[-1, 1::3] = False
    return mask


def assert_matches_reference(q, k, v, mask=None, **options):
    fast = mita_attention(q, k, v, mask=mask, **options)
    reference_options = {key: value for key, value in options.items() if key != "pack"}
    slow = mita_reference(q, k, v, mask=mask, **reference_options)
    real = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if mask is None else mask
    weight = torch.randn_like(slow) * real[:, None, :, None]
    torch.testing.assert_close(fast.out * real[:, None, :, None], slow * real[:, None, :, None])
    fast_grads = torch.autograd.grad((fast.out * weight).sum(), (q, k, v))
    slow_grads = torch.autograd.grad((slow * weight).sum(), (q, k, v))
    for fast_grad, slow_grad in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(fast_grad, slow_grad)
    return fast


SETTINGS = [
    {"landmarks": 4, "topk": 5, "route": 1},
    {"landmarks": 4, "topk": 5, "route": 2},
    {"landmarks": 5, "topk": 30, "route": 1},  # top-k wider than the sequence: every key
    {"landmarks": 3, "topk": 0},  # agent
    {"landmarks": 4, "topk": 6, "shared": False},  # route-only
    {"landmarks": 4, "topk": 6, "route": 3, "shared": False},
    {"landmarks": 2, "topk": 3, "route": 2},  # causal: a window of 2 of the 5 landmarks
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("padded", [None, "right", "left", "scattered"])
# pack=1 makes the long-sequence path (one call per expert) run; pack=4 the packed path.
@pytest.mark.parametrize("pack", [1, 4])
def test_fast_path_matches_reference_forward_and_gradients(causal, settings, padded, pack):
    q, k, v = qkv()
    mask = None if padded is None else padding_mask(2, 23, side=padded)
    block = {"block": BLOCK} if causal else {}
    assert_matches_reference(q, k, v, mask=mask, causal=causal, pack=pack, **block, **settings)


@pytest.mark.parametrize("settings", [{"landmarks": 4, "topk": 5}, {"landmarks": 8, "topk": 3, "route": 2},
                                      {"landmarks": 6, "topk": 0}])
@pytest.mark.parametrize("padded", [False, True])
def test_grid_pooling_with_a_cls_token_matches_reference(settings, padded):
    # A padded grid keeps every token's window (the grid fixes it): padding is only left out.
    q, k, v = qkv(length=1 + 6 * 5)
    mask = padding_mask(2, 31, pad=7, side="scattered") if padded else None
    assert_matches_reference(q, k, v, grid=(6, 5), extra_tokens=1, pack=2, mask=mask, **settings)


def test_grid_landmarks_are_means_over_subgrids():
    # With topk = 0 and one landmark per 2x2 cell, the landmark values can be checked by hand.
    q, k, v = qkv(batch=1, heads=1, length=16, dim=4)
    out = mita_attention(q, k, v, landmarks=4, topk=0, grid=(4, 4)).out
    image = q[0, 0].view(4, 4, 4)
    landmarks = torch.stack([image[r:r + 2, c:c + 2].reshape(4, 4).mean(0) for r in (0, 2) for c in (0, 2)])
    scale = 4 ** -0.5
    landmark_values = torch.softmax(landmarks @ k[0, 0].T * scale, -1) @ v[0, 0]
    expected = torch.softmax(q[0, 0] @ landmarks.T * scale, -1) @ landmark_values
    torch.testing.assert_close(out[0, 0], expected)
    assert grid_pool_shape(8) == (2, 4) and grid_pool_shape(25) == (5, 5) and grid_pool_shape(7) == (1, 7)


def test_full_width_experts_are_one_softmax_over_all_keys_plus_landmarks():
    """r = 1 and k = N: the routed expert holds every key, so MiTA = softmax over [L; K] with [V̂; V]."""
    q, k, v = qkv(batch=1, heads=2, length=20, dim=8)
    out = mita_attention(q, k, v, landmarks=4, topk=20).out
    landmarks = q.view(1, 2, 4, 5, 8).mean(3)  # 20 tokens / 4 windows of 5
    scale = 8 ** -0.5
    landmark_values = torch.softmax(landmarks @ k.transpose(-1, -2) * scale, -1) @ v
    expected = F.scaled_dot_product_attention(
        q, torch.cat([landmarks, k], 2), torch.cat([landmark_values, v], 2))
    torch.testing.assert_close(out, expected)


def test_route_only_with_full_width_experts_is_full_attention():
    q, k, v = qkv(batch=2, heads=2, length=19, dim=8)
    out = mita_attention(q, k, v, landmarks=3, topk=19, shared=False).out
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_agent_preset_is_two_stage_compression():
    q, k, v = qkv(batch=1, heads=1, length=12, dim=8)
    out = mita_attention(q, k, v, landmarks=3, topk=0).out
    landmarks = q.view(1, 1, 3, 4, 8).mean(3)
    landmark_values = F.scaled_dot_product_attention(landmarks, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, landmarks, landmark_values))


def test_causal_variant_never_reads_the_future():
    q, k, v = qkv(length=29)
    base = mita_attention(q, k, v, landmarks=5, topk=4, route=2, causal=True, block=BLOCK).out
    for t in (0, 5, 6, 17, 28):
        later = [tensor.detach().clone() for tensor in (q, k, v)]
        for tensor in later:
            tensor[:, :, t + 1:] = torch.randn_like(tensor[:, :, t + 1:]) * 5
        out = mita_attention(*later, landmarks=5, topk=4, route=2, causal=True, block=BLOCK).out
        torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1])


@pytest.mark.parametrize("settings", [{"landmarks": 3, "topk": 4, "route": 2}, {"landmarks": 8, "topk": 0},
                                      {"landmarks": 2, "topk": 5, "shared": False}], ids=str)
def test_causal_prefix_is_independent_of_the_total_length(settings):
    """Streaming: the first t outputs of a length-N input are the outputs of its length-t prefix,
    for t inside, at and across block boundaries (before the fix, blocks were N / landmarks long)."""
    q, k, v = qkv(length=31)
    whole = mita_attention(q, k, v, causal=True, block=BLOCK, **settings).out
    for t in (1, 3, 4, 5, 8, 9, 16, 30):
        prefix = mita_attention(q[:, :, :t], k[:, :, :t], v[:, :, :t], causal=True, block=BLOCK,
                                **settings).out
        torch.testing.assert_close(prefix, whole[:, :, :t], msg=lambda m, t=t: f"prefix of {t}: {m}")


def test_causal_first_block_is_exact_causal_attention():
    q, k, v = qkv(length=24)
    out = mita_attention(q, k, v, landmarks=4, topk=3, causal=True, block=6).out
    first = F.scaled_dot_product_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], is_causal=True)
    torch.testing.assert_close(out[:, :, :6], first)
    # A block longer than the input makes it one block: exact causal attention (no clamping).
    whole = mita_attention(q, k, v, landmarks=4, topk=3, causal=True, block=64).out
    torch.testing.assert_close(whole, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_sequences_shorter_than_the_landmark_count_work(causal):
    # Generation starts from short prompts: E > N gives one-token windows (causal: fewer completed
    # blocks than the landmark cap, and experts holding fewer keys than topk).
    q, k, v = qkv(length=5)
    block = {"block": 2} if causal else {}
    assert_matches_reference(q, k, v, landmarks=25, topk=25, causal=causal, pack=2, **block)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("side", ["right", "left", "scattered"])
def test_padded_rows_holding_nan_leave_real_rows_as_if_alone(causal, side):
    """Padding takes no place in the layout: the real tokens of a padded row give what they give
    alone, whatever the padded rows hold (NaN here), and no gradient reaches padded rows."""
    q, k, v = qkv(batch=2, length=23)
    mask = padding_mask(2, 23, pad=9, side=side)
    options = {"landmarks": 3, "topk": 4, "route": 2, "causal": causal}
    options.update({"block": BLOCK} if causal else {})
    alone = mita_attention(*(t[1:, :, mask[1]] for t in (q, k, v)), **options).out
    padded = ~mask[:, None, :, None]
    poisoned = [t.detach().masked_fill(padded, float("nan")).requires_grad_() for t in (q, k, v)]
    out = mita_attention(*poisoned, mask=mask, **options).out
    torch.testing.assert_close(out[1:, :, mask[1]], alone)
    torch.testing.assert_close(out[:1], mita_attention(*(t[:1] for t in (q, k, v)), **options).out)
    out.masked_fill(padded, 0.0).sum().backward()
    for tensor in poisoned:
        assert torch.isfinite(tensor.grad).all() and tensor.grad.masked_select(padded).abs().max() == 0


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)],
                         ids=["bf16", "fp16"])
def test_low_precision_is_the_fp32_op_rounded(causal, dtype, tolerance):
    """fp16/bf16 run in fp32 inside (no −1e30 constant meets fp16): output and gradients are the
    fp32 op's on the same (rounded) inputs, up to rounding the results to `dtype` — relative error
    (norm) ≤ 1e-2 in bf16 (unit roundoff 2^-9 per element), 2e-3 in fp16 (2^-12)."""
    low = [t.detach().to(dtype).requires_grad_() for t in qkv(length=40, dim=16)]
    high = [t.detach().float().requires_grad_() for t in low]
    mask = padding_mask(2, 40, pad=7)
    options = {"landmarks": 3, "topk": 4, "route": 2, "causal": causal, "mask": mask,
               **({"block": 8} if causal else {})}
    out_low, out_high = mita_attention(*low, **options).out, mita_attention(*high, **options).out
    assert out_low.dtype == dtype and torch.isfinite(out_low).all()
    real = mask[:, None, :, None]

    def relative(a, b):
        return float((a.detach().float() - b.detach()).norm() / b.detach().norm())

    assert relative(out_low * real, out_high * real) <= tolerance
    weight = torch.randn(out_high.shape, generator=torch.Generator().manual_seed(3)) * real
    (out_low.float() * weight).sum().backward()
    (out_high * weight).sum().backward()
    for a, b in zip(low, high, strict=True):
        assert a.grad.dtype == dtype and torch.isfinite(a.grad).all()
        assert relative(a.grad, b.grad) <= tolerance


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(0, 3, 7), (2, 3, 0), (0, 3, 0)])
def test_empty_inputs_give_empty_outputs(causal, shape):
    q, k, v = (torch.randn(*shape, 8, requires_grad=True) for _ in range(3))
    result = mita_attention(q, k, v, landmarks=3, topk=2, causal=causal)
    assert result.out.shape == (*shape, 8) and result.flops == 0
    result.out.sum().backward()
    assert q.grad is None or q.grad.shape == q.shape
    assert mita_reference(q, k, v, landmarks=3, topk=2, causal=causal).shape == (*shape, 8)


@pytest.mark.parametrize("causal", [False, True])
def test_a_single_token_reads_itself(causal):
    q, k, v = qkv(length=1)
    out = mita_attention(q, k, v, landmarks=3, topk=2, causal=causal).out
    if causal:
        torch.testing.assert_close(out, v)
    assert_matches_reference(q, k, v, landmarks=3, topk=2, causal=causal, pack=1)


@pytest.mark.parametrize("with_padding", [False, True])
def test_chunked_landmark_attention_matches_its_reference(monkeypatch, with_padding):
    """The landmark stage in many chunks (one landmark each) with its recomputing backward."""
    monkeypatch.setattr(mita_landmarks, "_CHUNK_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(5)
    landmark = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 20, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    limit = torch.tensor([[4, 8, 12, 16, 20, 20], [4, 8, 11, 11, 11, 0]])  # causal blocks of 4; a short row
    key_real = (torch.rand(2, 20, generator=gen) > 0.3) if with_padding else None
    fast = landmark_attention(landmark, k, v, limit, topk=6, scale=0.3, key_real=key_real)
    slow = landmark_attention_reference(landmark, k, v, limit, topk=6, scale=0.3, key_real=key_real)
    torch.testing.assert_close(fast[0], slow[0])
    torch.testing.assert_close(fast[2], slow[2])  # as many keys per expert
    for (index, valid) in (fast[1:], slow[1:]):  # and the same key sets (in any order)
        index.masked_fill_(~valid, -1)
    torch.testing.assert_close(fast[1].sort(-1).values, slow[1].sort(-1).values)
    assert not fast[2][1, :, 5].any()  # a landmark that may read nothing holds no key
    weight = torch.randn_like(slow[0])
    for a, b in zip(torch.autograd.grad((fast[0] * weight).sum(), (landmark, k, v)),
                    torch.autograd.grad((slow[0] * weight).sum(), (landmark, k, v)), strict=True):
        torch.testing.assert_close(a, b)


def test_flops_grow_linearly_and_stay_below_full_attention():
    flops = {}
    for length in (512, 2048):
        q, k, v = (t.detach().float() for t in qkv(batch=1, heads=1, length=length, dim=16))
        flops[length] = mita_attention(q, k, v, landmarks=8, topk=8).flops
        assert flops[length] < 4 * length * length * 16 / 4
    assert flops[2048] / flops[512] < 4.5  # linear: x4 tokens, about x4 work (quadratic: x16)


def test_expert_load_is_a_distribution_over_experts():
    q, k, v = qkv()
    load = mita_attention(q, k, v, landmarks=4, topk=5).expert_load
    assert load.shape == (4,) and torch.isclose(load.sum(), torch.tensor(1.0, dtype=load.dtype))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"landmarks": 0}, "landmarks must be a positive integer"),
        ({"topk": -1}, "topk must be an integer >= 0"),
        ({"route": 0}, "route must be a positive integer"),
        ({"grid": (4, 4)}, "grid .4, 4. holds 16 tokens"),
        ({"grid": (23, 1), "landmarks": 4}, "larger than the 23x1 token grid"),
        ({"causal": True, "grid": (23, 1)}, "grid and extra_tokens are for non-causal"),
        ({"extra_tokens": 23}, "leaves no token to pool"),
        ({"topk": 0, "shared": False}, "no key to attend to"),
        ({"block": 4}, "block is the causal build's block length"),
        ({"causal": True, "block": 0}, "block must be a positive integer"),
    ],
)
def test_bad_settings_raise_value_errors(options, message):
    q, k, v = qkv()
    settings = {"landmarks": 4, "topk": 5, **options}
    with pytest.raises(ValueError, match=message):
        mita_attention(q, k, v, **settings)
