"""mita_attention against mita_reference, its limiting identities, causality and its errors."""

import pytest
import torch
import torch.nn.functional as F

from routeformer.ops.mita import grid_pool_shape, mita_attention, mita_reference


def qkv(batch=2, heads=3, length=23, dim=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=gen, dtype=dtype).requires_grad_()
            for _ in range(3)]


def padding_mask(batch, length, pad=5):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[-1, length - pad:] = False
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
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("padded", [False, True])
# pack=1 makes the long-sequence path (one call per expert) run; pack=4 the packed path.
@pytest.mark.parametrize("pack", [1, 4])
def test_fast_path_matches_reference_forward_and_gradients(causal, settings, padded, pack):
    q, k, v = qkv()
    mask = padding_mask(2, 23) if padded else None
    assert_matches_reference(q, k, v, mask=mask, causal=causal, pack=pack, **settings)


@pytest.mark.parametrize("settings", [{"landmarks": 4, "topk": 5}, {"landmarks": 8, "topk": 3, "route": 2},
                                      {"landmarks": 6, "topk": 0}])
def test_grid_pooling_with_a_cls_token_matches_reference(settings):
    q, k, v = qkv(length=1 + 6 * 5)
    assert_matches_reference(q, k, v, grid=(6, 5), extra_tokens=1, pack=2, **settings)


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
    base = mita_attention(q, k, v, landmarks=5, topk=4, route=2, causal=True).out
    for t in (0, 5, 6, 17, 28):
        later = [tensor.detach().clone() for tensor in (q, k, v)]
        for tensor in later:
            tensor[:, :, t + 1:] = torch.randn_like(tensor[:, :, t + 1:]) * 5
        out = mita_attention(*later, landmarks=5, topk=4, route=2, causal=True).out
        torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1])


def test_causal_first_block_is_exact_causal_attention():
    q, k, v = qkv(length=24)
    out = mita_attention(q, k, v, landmarks=4, topk=3, causal=True).out  # blocks of 6
    first = F.scaled_dot_product_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], is_causal=True)
    torch.testing.assert_close(out[:, :, :6], first)


@pytest.mark.parametrize("causal", [False, True])
def test_sequences_shorter_than_the_landmark_count_work(causal):
    # Generation starts from short prompts: E > N gives one-token windows (causal: N blocks of 1).
    q, k, v = qkv(length=5)
    assert_matches_reference(q, k, v, landmarks=25, topk=25, causal=causal, pack=2)


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
    ],
)
def test_bad_settings_raise_value_errors(options, message):
    q, k, v = qkv()
    settings = {"landmarks": 4, "topk": 5, **options}
    with pytest.raises(ValueError, match=message):
        mita_attention(q, k, v, **settings)
