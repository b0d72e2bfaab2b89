"""multihop and expanding ops: fast paths equal their references; the properties the paper claims."""

import pytest
import torch

from routeformer.ops import (
    expanding_attention,
    expanding_attention_reference,
    full_attention,
    multihop_attention,
    multihop_attention_reference,
)
from routeformer.ops.expanding import geometric_horizon
from routeformer.ops.expanding.op import _STEP_FLOPS_PER_ENTRY
from routeformer.ops.native.kernel_flops import band_attend_flops


def make_inputs(length, padded, seed=0, batch=2, heads=3, dim=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=gen, dtype=dtype) for _ in range(3))
    mask = None
    if padded:
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[1] = torch.rand(length, generator=gen) > 0.3
        mask[1, length - length // 4:] = False
    return q, k, v, mask


def grads(output, inputs, seed=1):
    weight = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed), dtype=output.dtype)
    return torch.autograd.grad((output * weight).sum(), inputs)


# -- multihop -------------------------------------------------------------------------------------
@pytest.mark.parametrize("form,causal", [("paper", True), ("paper", False), ("authors", False)])
@pytest.mark.parametrize("hops", [1, 2, 3])
@pytest.mark.parametrize("identity", [None, True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_multihop_matches_reference(form, causal, hops, identity, padded):
    q, k, v, mask = make_inputs(19, padded)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    options = dict(hops=hops, identity=identity, form=form, causal=causal, mask=mask)
    fast = multihop_attention(q, k, v, **options)
    reference = multihop_attention_reference(q, k, v, **options)
    torch.testing.assert_close(fast, reference, atol=1e-10, rtol=1e-10)
    for got, want in zip(grads(fast, leaves), grads(reference, leaves), strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_multihop_one_hop_is_attention_and_two_hops_add_the_second_path():
    q, k, v, _ = make_inputs(16, padded=False)
    one_hop = full_attention(q, k, v, causal=True)
    torch.testing.assert_close(multihop_attention(q, k, v, hops=1, causal=True), one_hop)
    two_hops = multihop_attention(q, k, v, hops=2, causal=True)
    torch.testing.assert_close(two_hops, one_hop + full_attention(q, k, one_hop, causal=True))
    with_identity = multihop_attention(q, k, v, hops=2, identity=True, causal=True)
    torch.testing.assert_close(with_identity, two_hops + v)


def test_multihop_authors_form_is_a_convex_mixture_of_paths():
    """Rows of the authors' (I + P̃ + P̃²)/3 sum to one: a constant value passes through unchanged."""
    q, k, _, _ = make_inputs(12, padded=False)
    ones = torch.ones(*q.shape[:3], 1, dtype=q.dtype)
    out = multihop_attention(q, k, ones, form="authors")
    torch.testing.assert_close(out, ones)
    # ... while the paper's sum of two row-stochastic paths doubles it.
    torch.testing.assert_close(multihop_attention(q, k, ones, form="paper"), 2 * ones)


@pytest.mark.parametrize("call,message", [
    (lambda q: multihop_attention(q, q, q, hops=0), "hops must be a positive integer"),
    (lambda q: multihop_attention(q, q, q, form="mean"), "form must be one of"),
    (lambda q: multihop_attention(q, q, q, form="authors", causal=True), "needs causal=False"),
    (lambda q: multihop_attention(q, q[:, :, :3], q[:, :, :3]), "queries as keys"),
])
def test_multihop_bad_options_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 2, 5, 4))


# -- expanding ------------------------------------------------------------------------------------
PRIORS = {
    "short": ([1.0, 0.5, 2.0], [4.0, 20.0, 1.0]),
    "wide": ([0.2, 1.0, 3.0], [30.0, 60.0, 3.0]),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,block", [(1, 4), (37, 4), (64, 8), (100, 16), (20, 64)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("prior", list(PRIORS))
def test_expanding_matches_reference(implementation, causal, length, block, padded, prior):
    q, k, v, mask = make_inputs(length, padded, seed=length)
    alpha, beta = (torch.tensor(values, dtype=torch.float64, requires_grad=True) for values in PRIORS[prior])
    leaves = [t.requires_grad_() for t in (q, k, v)] + [alpha, beta]
    fast = expanding_attention(q, k, v, alpha, beta, causal=causal, mask=mask, block=block)
    reference, horizon, iterations = expanding_attention_reference(
        q, k, v, alpha, beta, causal=causal, mask=mask)
    assert torch.equal(fast.horizon, horizon) and torch.equal(fast.iterations, iterations)
    torch.testing.assert_close(fast.out, reference, atol=1e-10, rtol=1e-10)
    fast_grads, reference_grads = grads(fast.out, leaves), grads(reference, leaves)
    for got, want in zip(fast_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    if length > 1:
        assert fast_grads[3].abs().sum() > 0 and fast_grads[4].abs().sum() > 0, "the prior must learn"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gather_below", [0.0, 1.01])
def test_expanding_steps_by_block_rows_or_gathered_queries_agree(monkeypatch, causal, gather_below):
    """An inference step runs over whole block rows or over the gathered going-on queries (when
    few go on); forcing either path everywhere gives the reference's result."""
    import routeformer.ops.expanding.band as band_module

    monkeypatch.setattr(band_module, "GATHER_BELOW", gather_below)
    q, k, v, mask = make_inputs(90, padded=True, seed=3)
    alpha, beta = (torch.tensor(values, dtype=torch.float64) for values in PRIORS["wide"])
    fast = expanding_attention(q, k, v, alpha, beta, causal=causal, mask=mask, block=16)
    reference, horizon, iterations = expanding_attention_reference(
        q, k, v, alpha, beta, causal=causal, mask=mask)
    assert iterations.max() > 2, "the inputs must take several steps"
    assert torch.equal(fast.horizon, horizon) and torch.equal(fast.iterations, iterations)
    torch.testing.assert_close(fast.out, reference, atol=1e-10, rtol=1e-10)


def test_expanding_fp32_matches_fp64(implementation):
    q, k, v, mask = make_inputs(70, padded=True, dtype=torch.float32)
    alpha, beta = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([9.0, 3.0, 30.0])
    fast = expanding_attention(q, k, v, alpha, beta, mask=mask, block=16)
    wide = expanding_attention(*(t.double() for t in (q, k, v, alpha, beta)), mask=mask, block=16)
    torch.testing.assert_close(fast.out, wide.out.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [37, 300])
def test_expanding_fp32_unpadded_matches_fp64(implementation, length):
    """Causal and unpadded: in fp32 the native kernels run their vectorised paths (register tiles,
    8-lane exponentials and sums); they must agree with the fp64 result."""
    q, k, v, _ = make_inputs(length, padded=False, dtype=torch.float32, dim=16)
    alpha, beta = torch.tensor([1.0, 1.0, 0.5]), torch.tensor([9.0, 60.0, 2.0])
    fast = expanding_attention(q, k, v, alpha, beta)
    wide = expanding_attention(*(t.double() for t in (q, k, v, alpha, beta)))
    assert (fast.horizon != wide.horizon).float().mean() < 0.01  # a rounding may flip a rare ceil
    same = (fast.horizon == wide.horizon)[..., None]
    torch.testing.assert_close(fast.out * same, wide.out.float() * same, atol=1e-5, rtol=1e-5)


def test_horizon_keeps_the_prior_tail_below_tol():
    alpha, beta = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 9.0, 98.0])
    horizon = geometric_horizon(alpha, beta, 0.01, torch.tensor(10_000))
    decay = 1 - alpha / (alpha + beta)
    assert bool((decay ** horizon <= 0.01).all()) and bool((decay ** (horizon - 1) > 0.01).all())
    assert horizon.tolist() == [7, 44, 228]  # ceil(log .01 / log(1 - q)) for q = 1/2, 1/10, 1/50
    assert geometric_horizon(alpha, beta, 0.01, torch.tensor(30)).tolist() == [7, 30, 30]


def test_flat_prior_with_full_horizon_is_full_attention(implementation):
    """q -> 0: the horizon covers the context and the prior is flat, so expanding = softmax attention."""
    q, k, v, _ = make_inputs(50, padded=False)
    alpha, beta = torch.full((3,), 1e-6, dtype=torch.float64), torch.full((3,), 1e6, dtype=torch.float64)
    for causal in (True, False):
        result = expanding_attention(q, k, v, alpha, beta, causal=causal, block=8)
        torch.testing.assert_close(result.out, full_attention(q, k, v, causal=causal), atol=1e-9, rtol=1e-9)
        assert result.iterations.max() == 1, "a horizon at the context stops after one step"


def test_window_grows_when_attention_sits_far_back_and_not_otherwise(implementation):
    """The matching key lies 15 back (inside the starting horizon of 21): the inferred window grows
    past it. With the matching key next door, the window shrinks below the prior's. (A match
    beyond the starting horizon is invisible to the inference: the window grows only towards mass
    it can see — the mechanism's local-search nature.)"""
    length, dim = 256, 16
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 1, length, dim, generator=gen)
    v = torch.randn(1, 1, length, dim, generator=gen)
    alpha, beta = torch.tensor([1.0]), torch.tensor([4.0])  # starting horizon 21
    results = {}
    for lag in (1, 15):
        q = base * 4
        k = torch.roll(base, shifts=-lag, dims=2)  # key j matches query j + lag
        results[lag] = expanding_attention(q, k, v, alpha, beta, block=16)
    far, near = results[15].horizon[0, 0, 100:], results[1].horizon[0, 0, 100:]
    assert bool((far > 30).all()), far.min()
    assert near.float().mean() < 21 and far.float().mean() > 3 * near.float().mean()
    assert results[15].iterations.float().mean() > results[1].iterations.float().mean()


def test_keys_beyond_a_blocks_largest_horizon_are_never_scored(monkeypatch):
    """Scored pairs are bounded by the block rows' largest horizons (rounded up to whole blocks):
    the PyTorch path's band (the native kernels score per query, see the flops test)."""
    monkeypatch.setenv("ROUTEFORMER_NATIVE", "0")
    q, k, v, _ = make_inputs(200, padded=False, heads=2)
    alpha, beta = torch.tensor([2.0, 2.0], dtype=torch.float64), torch.tensor([4.0, 8.0], dtype=torch.float64)
    block = 8
    result = expanding_attention(q, k, v, alpha, beta, block=block)
    horizon = result.horizon.reshape(-1, 25, block)
    bound = sum(block * block * (1 + (int(h.max()) + 2 * block - 2) // block) for row in horizon for h in row)
    assert result.scored_pairs <= bound
    assert result.scored_pairs < 0.5 * 2 * 2 * 200 * 201 // 2  # well below full causal attention


def test_iterations_respect_max_iters(implementation):
    q, k, v, _ = make_inputs(120, padded=False)
    alpha, beta = torch.full((3,), 0.3, dtype=torch.float64), torch.full((3,), 3.0, dtype=torch.float64)
    for max_iters in (1, 2, 5):
        result = expanding_attention(q, k, v, alpha, beta, max_iters=max_iters, block=8)
        assert int(result.iterations.max()) <= max_iters


@pytest.mark.parametrize("call,message", [
    (lambda q, a: expanding_attention(q, q, q, a, a, tol=0.0), "tol must be a number in"),
    (lambda q, a: expanding_attention(q, q, q, a, a, tol=1.5), "tol must be a number in"),
    (lambda q, a: expanding_attention(q, q, q, a, a, max_iters=0), "max_iters must be a positive"),
    (lambda q, a: expanding_attention(q, q, q, a, a, block=0), "block must be a positive"),
    (lambda q, a: expanding_attention(q, q, q, a[:1], a), r"alpha must have shape \[H\]"),
    (lambda q, a: expanding_attention(q, q, q, a, -a), "beta must be positive"),
])
def test_expanding_bad_options_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 2, 5, 4), torch.ones(2))


def test_expanding_reports_executed_flops(implementation):
    q, k, v, _ = make_inputs(64, padded=False)
    alpha, beta = torch.ones(3, dtype=torch.float64), torch.full((3,), 9.0, dtype=torch.float64)
    result = expanding_attention(q, k, v, alpha, beta, block=8)
    dim = q.shape[-1]
    steps = _STEP_FLOPS_PER_ENTRY * result.step_entries
    if implementation == "torch":
        assert result.flops == 2 * dim * (result.scored_pairs + result.value_pairs) + steps
    else:  # the final pass as the query-blocked kernel runs it: whole key tiles, three-query groups
        horizon = result.horizon.reshape(-1, 64)
        final = band_attend_flops(horizon, torch.arange(64).expand_as(horizon), dim, dim)
        assert final >= 4 * dim * result.value_pairs
        assert result.flops == 2 * dim * (result.scored_pairs - result.value_pairs) + final + steps
    if implementation == "torch":
        assert result.value_pairs >= result.scored_pairs
        # The final softmax alone covers every query over a band at least as wide as its horizon.
        assert result.step_entries >= 2 * 3 * 64 * int(result.horizon.max())
    else:  # per query: the steps score up to the horizon once, the final pass scores it again
        inside = int(result.horizon.sum())
        assert result.value_pairs == inside
        assert inside < result.scored_pairs <= 2 * inside and result.step_entries >= inside


# -- expanding, update="mean_field" ---------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,block,padded", [(37, 4, True), (64, 16, False), (5, 8, False)])
def test_expanding_mean_field_matches_reference(causal, length, block, padded):
    """The mean-field update runs on the band path; it equals its dense reference (forward,
    horizons, iterations, gradients to q, k, v and the prior)."""
    q, k, v, mask = make_inputs(length, padded, seed=length)
    alpha, beta = (torch.tensor(values, dtype=torch.float64, requires_grad=True) for values in PRIORS["wide"])
    leaves = [t.requires_grad_() for t in (q, k, v)] + [alpha, beta]
    fast = expanding_attention(q, k, v, alpha, beta, causal=causal, mask=mask, block=block,
                               update="mean_field", max_iters=30)
    reference, horizon, iterations = expanding_attention_reference(
        q, k, v, alpha, beta, causal=causal, mask=mask, update="mean_field", max_iters=30)
    assert torch.equal(fast.horizon, horizon) and torch.equal(fast.iterations, iterations)
    torch.testing.assert_close(fast.out, reference, atol=1e-10, rtol=1e-10)
    for got, want in zip(grads(fast.out, leaves), grads(reference, leaves), strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def _final_mean_distance(q, k, alpha, beta, **options):
    """E[δ] of every query's final attention, read from the output with v = key position:
    E[δ] = i - Σ_j p_ij j."""
    length = q.shape[2]
    positions = torch.arange(length, dtype=q.dtype)
    v = positions.view(1, 1, length, 1).expand(*q.shape[:3], 1)
    out, _, iterations = expanding_attention_reference(q, k, v, alpha, beta, **options)
    return positions - out[..., 0], iterations


def test_expanding_mean_field_converges_to_a_fixed_point():
    """The mean-field iteration is monotone in E[δ] and stops on its own, long before max_iters;
    past that, more iterations change nothing. Its E[δ] after n steps is monotone in n."""
    q, k, _, _ = make_inputs(120, padded=False, seed=5)
    alpha = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    beta = torch.tensor([9.0, 20.0, 3.0], dtype=torch.float64)
    # From the second step on every step is the same map E -> E[δ | Beta(α + 1, β + E)], increasing in E.
    means = [_final_mean_distance(q, k, alpha, beta, update="mean_field", max_iters=n)[0]
             for n in (2, 3, 4, 5)]
    increments = [later - earlier for earlier, later in zip(means, means[1:], strict=False)]
    # Each query moves the same way at every step (monotone sequence), and the steps shrink.
    same_sign = (increments[0] * increments[1] >= -1e-9) & (increments[1] * increments[2] >= -1e-9)
    assert bool(same_sign.all())
    assert float(increments[2].abs().sum()) < float(increments[0].abs().sum())
    converged, iterations = _final_mean_distance(q, k, alpha, beta, update="mean_field", max_iters=60)
    assert int(iterations.max()) < 60, "every query must stop by its convergence rule"
    again, _ = _final_mean_distance(q, k, alpha, beta, update="mean_field", max_iters=90)
    assert torch.equal(converged, again)


def test_expanding_paper_update_depends_on_max_iters():
    """The paper's update accumulates one pseudo-observation per step, so its result depends on
    how many steps run: more steps than the default move the output (documented, not a bug)."""
    q, k, v, _ = make_inputs(120, padded=False, seed=5)
    alpha, beta = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64), torch.tensor([9.0, 20.0, 3.0],
                                                                                    dtype=torch.float64)
    few = expanding_attention_reference(q, k, v, alpha, beta, max_iters=4)[0]
    default = expanding_attention_reference(q, k, v, alpha, beta, max_iters=8)[0]
    assert float((few - default).abs().max()) > 1e-3


def test_expanding_bad_update_raises():
    with pytest.raises(ValueError, match="update must be one of"):
        expanding_attention(*(torch.randn(1, 2, 5, 4) for _ in range(3)), torch.ones(2), torch.ones(2),
                            update="exact")


def test_expanding_layer_takes_the_update_option():
    from routeformer.attention import build_attention

    torch.manual_seed(0)
    layer = build_attention("expanding", dim=16, heads=2, update="mean_field", block=8).double()
    x = torch.randn(2, 30, 16, dtype=torch.float64, requires_grad=True)
    result = layer(x)
    q, k, v = layer.project_qkv(x, torch.arange(30).expand(2, 30))
    reference = expanding_attention_reference(q, k, v, *layer.prior(), update="mean_field")[0]
    expected = layer.out_proj(layer.merge_heads(reference, x))
    torch.testing.assert_close(result.out, expected, atol=1e-10, rtol=1e-10)
    result.out.sum().backward()
    assert layer.alpha_raw.grad is not None and "update='mean_field'" in repr(layer)
    with pytest.raises(ValueError, match="update must be one of"):
        build_attention("expanding", dim=16, heads=2, update="exact")
