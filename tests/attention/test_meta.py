"""Meta-Attention: the controller's closed forms, hard routing against its dense twin, savings."""

import pytest
import torch
from torch.distributions import Dirichlet, kl_divergence

from routeformer.attention import build_attention
from routeformer.attention.meta import EXPERTS
from routeformer.attention.meta_router import DEFAULT_POSITION_SCALE, cost_prior
from routeformer.ops.full import full_attention_reference
from routeformer.ops.linear import linear_attention_reference
from routeformer.ops.local import local_attention_reference

DIM, HEADS, LENGTH = 32, 4, 23
SMALL = {"window": 5, "linear_chunk": 4, "full_chunk": 4}


def make(seed=0, **options):
    torch.manual_seed(seed)
    layer = build_attention("meta", dim=DIM, heads=HEADS, **{**SMALL, **options}).double()
    # Spread the controller's outputs so that certainties differ from token to token.
    torch.nn.init.normal_(layer.router.increments.weight, std=1.0)
    return layer


def tokens(seed=1, length=LENGTH):
    return torch.randn(2, length, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def median_certainty(layer, x):
    with torch.no_grad():
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        return float(layer.certainty(layer.router(x, positions)).median())


def dense_twin(layer, x, eta, mask=None):
    """Every expert on every token with the reference ops, then the hard/soft weights: the slow
    specification of what the routed-rows path computes."""
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    concentration = layer.router(x, positions)
    mean = concentration / concentration.sum(-1, keepdim=True)
    weights = mean
    if eta is not None:
        hard = layer.certainty(concentration) >= eta
        one_hot = torch.nn.functional.one_hot(mean.argmax(-1), 3).to(x.dtype)
        weights = torch.where(hard[..., None], one_hot * (1 + mean - mean.detach()), mean)
    out = 0
    for index, name in enumerate(EXPERTS):
        q = layer._queries(index, x, positions)
        k, v = layer._keys_values(index, x, positions, {})
        if name == "full":
            heads_out = full_attention_reference(q, k, v, mask=mask, causal=layer.causal)
        elif name == "linear":
            heads_out = linear_attention_reference(q, k, v, mask=mask, causal=layer.causal)
        else:
            heads_out = local_attention_reference(q, k, v, window=layer.window, mask=mask,
                                                  causal=layer.causal)
        out = out + weights[..., index:index + 1] * layer.expert_out[index](layer.merge_heads(heads_out, x))
    return out


def test_prior_follows_equation_1_and_refuses_improper_concentrations():
    torch.testing.assert_close(cost_prior((1.0, 0.15, 0.30), 1.0, 0.01), torch.tensor([0.01, 0.86, 0.71]))
    with pytest.raises(ValueError, match="improper Dirichlet"):
        build_attention("meta", dim=DIM, heads=HEADS, costs=(1.2, 0.15, 0.3))
    with pytest.raises(ValueError, match="prior_eps must be > 0"):
        build_attention("meta", dim=DIM, heads=HEADS, prior_eps=0.0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_hard_routing_matches_the_dense_twin(causal, rotary, masked):
    layer = make(causal=causal, rotary=rotary).eval()
    x = tokens().requires_grad_()
    mask = None
    if masked:
        mask = torch.ones(2, LENGTH, dtype=torch.bool)
        mask[1, 17:] = False
    layer.eval_eta = median_certainty(layer, x)
    result = layer(x, mask=mask)
    assert 0.3 < result.stats["hard_fraction"] < 0.7, "the test needs both hard and soft tokens"
    expected = dense_twin(layer, x, layer.eval_eta, mask)
    real = torch.ones(2, LENGTH, 1, dtype=torch.bool) if mask is None else mask[..., None]
    torch.testing.assert_close(result.out * real, expected * real, atol=1e-6, rtol=1e-6)
    weights = torch.randn(result.out.shape, dtype=torch.float64) * real
    parameters = [x, *layer.parameters()]
    got = torch.autograd.grad((result.out * weights).sum(), parameters, allow_unused=True)
    want = torch.autograd.grad((expected * weights).sum(), parameters, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_soft_routing_is_the_posterior_mean_mixture():
    layer = make().eval()
    x = tokens()
    torch.testing.assert_close(layer(x).out, dense_twin(layer, x, None), atol=1e-6, rtol=1e-6)


def test_hard_routing_never_sees_the_future():
    layer = make().eval()
    gen = torch.Generator().manual_seed(5)
    x = tokens()
    layer.eval_eta = median_certainty(layer, x)
    base = layer(x).out
    for t in (1, 9, 16):
        perturbed = x.clone()
        perturbed[:, t:] = torch.randn(2, LENGTH - t, DIM, generator=gen, dtype=torch.float64) * 3
        out = layer(perturbed).out
        # 1e-6, not 0: the linear expert sums its state in fp32, so shapes that change with routing
        # change the rounding (by ~1e-8), never more.
        assert (out[:, :t] - base[:, :t]).abs().max() <= 1e-6, f"leak from t >= {t}"
        assert not torch.allclose(out[:, t:], base[:, t:])


def test_hard_routing_sends_gradient_to_the_controller_and_saves_flops():
    layer = make(window=16, linear_chunk=16, full_chunk=64).train()
    x = tokens(length=256)
    soft = layer(x)
    layer.train_eta, layer.eta_anneal_steps = 0.0, 0  # every token hard
    hard = layer(x)
    assert hard.stats["hard_fraction"] == 1.0
    hard.out.pow(2).sum().backward()
    gradient = layer.router.increments.weight.grad
    assert gradient is not None and gradient.abs().sum() > 0
    assert hard.stats["flops"] < 0.6 * soft.stats["flops"]
    computed = sum(float(hard.stats[f"rows_{name}"]) for name in EXPERTS)
    assert computed == pytest.approx(1.0), "each hard token runs exactly one expert"


def test_training_samples_the_posterior_and_evaluation_uses_its_mean():
    layer = make()
    x = tokens()
    layer.train()
    assert not torch.allclose(layer(x).out, layer(x).out)
    layer.eval()
    torch.testing.assert_close(layer(x).out, layer(x).out)
    layer.sample_routing = False
    layer.train()
    torch.testing.assert_close(layer(x).out, layer.eval()(x).out)


def test_elbo_penalty_is_the_weighted_mean_kl():
    layer = make(elbo_weight=0.5).eval()
    x = tokens()
    result = layer(x)
    positions = torch.arange(LENGTH).expand(2, -1)
    concentration = layer.router(x, positions)
    prior = torch.tensor([0.01, 0.86, 0.71], dtype=torch.float64).expand_as(concentration)
    kl = kl_divergence(Dirichlet(concentration), Dirichlet(prior)).mean()
    torch.testing.assert_close(result.aux_loss, 0.5 * kl)
    assert result.aux_loss > 0, "a positive penalty: moving away from the prior costs"
    torch.testing.assert_close(result.stats["kl"], kl.detach())


def test_prior_free_ablation_has_no_prior_and_no_penalty():
    layer = make(prior="none", elbo_weight=0.0).eval()
    x = tokens()
    assert layer(x).aux_loss == 0
    positions = torch.arange(LENGTH).expand(2, -1)
    # The position feature: position / position_scale (default), or the paper's position / (T - 1).
    for scale, expected_scale in ((DEFAULT_POSITION_SCALE, DEFAULT_POSITION_SCALE), (None, LENGTH - 1)):
        layer.router.position_scale = scale
        increments = layer.router.increments(torch.nn.functional.gelu(layer.router.hidden(torch.cat([
            layer.router.norm(x), x.norm(dim=-1, keepdim=True) / DIM ** 0.5,
            (positions / expected_scale).to(x.dtype)[..., None]], -1))))
        expected = torch.nn.functional.softplus(increments) + 0.01
        torch.testing.assert_close(layer.router(x, positions), expected)


def test_kl_free_and_prior_free_each_change_one_thing():
    """KL-free keeps the posterior β + δ and drops the penalty; prior-free drops the offset β (ε + δ)
    and keeps the penalty KL[Dir(ε + δ) ‖ Dir(β)]. Same seed, same controller weights throughout."""
    x = tokens()
    positions = torch.arange(LENGTH).expand(2, -1)
    prior = torch.tensor([0.01, 0.86, 0.71], dtype=torch.float64)
    bayesian, kl_free = make(elbo_weight=0.7).eval(), make(elbo_weight=0.0).eval()
    prior_free = make(prior="none", elbo_weight=0.7).eval()
    increments = bayesian.router(x, positions) - prior  # δ(x), shared by all three (same weights)
    torch.testing.assert_close(kl_free.router(x, positions), prior + increments)
    torch.testing.assert_close(prior_free.router(x, positions), 0.01 + increments)
    torch.testing.assert_close(kl_free(x).out, bayesian(x).out)  # the KL weight does not touch routing
    assert kl_free(x).aux_loss == 0 and kl_free(x).stats["kl"] > 0
    expected = kl_divergence(Dirichlet(0.01 + increments), Dirichlet(prior.expand_as(increments))).mean()
    result = prior_free(x)
    torch.testing.assert_close(result.aux_loss, 0.7 * expected)
    assert not torch.allclose(result.out, bayesian(x).out)  # the offset does change routing
    result.aux_loss.backward()  # the penalty reaches the controller
    assert prior_free.router.increments.weight.grad.abs().sum() > 0


def test_eta_anneals_over_training_calls_and_the_step_is_checkpointed():
    layer = make(train_eta=0.2, train_eta_start=1.0, eta_anneal_steps=4, eval_eta=0.5).train()
    x = tokens()
    seen = []
    for _ in range(6):
        seen.append(layer.current_eta())
        layer(x)
    assert seen == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert int(layer.state_dict()["routing_step"]) == 6
    assert layer.eval().current_eta() == 0.5


def test_warmup_mixes_uniformly_without_kl_or_hard_routing_then_routes():
    """warmup_steps: the first N training calls use the fixed uniform mixture (the same output as
    sampling-free routing with weights 1/3), no KL and no hard tokens; then the paper's rules."""
    layer = make(warmup_steps=2, train_eta=0.0, train_eta_start=0.0, sample_routing=False).train()
    x = tokens()
    first = layer(x)
    assert first.aux_loss.item() == 0.0 and first.stats["hard_fraction"] == 0.0
    assert first.stats["kl_weight"] == 0.0 and first.stats["eta"].isnan()
    # The uniform mixture is the mean of the three experts' dense outputs.
    with torch.no_grad():
        positions = torch.arange(LENGTH).expand(2, -1)
        uniform = sum(layer._expert(i, x, positions, None, None, torch.full((2, LENGTH), 1 / 3,
                                                                              dtype=x.dtype), {},
                                    torch.zeros_like(x))[0] for i in range(3))
    torch.testing.assert_close(first.out, uniform)
    layer(x)
    after = layer(x)  # third call: warm-up over, η = train_eta = 0 → every token hard, KL on
    assert after.stats["hard_fraction"] == 1.0 and after.aux_loss.item() > 0
    assert int(layer.state_dict()["routing_step"]) == 3
    assert layer.eval()(x).stats["kl_weight"] == 1.0  # evaluation: no warm-up


def test_warmup_mixture_fixes_the_weights_of_the_warmup():
    """warmup_mixture=(1, 0, 0): during the warm-up the output is the full expert's alone."""
    layer = make(warmup_steps=1, warmup_mixture=(1.0, 0.0, 0.0)).train()
    x = tokens()
    out = layer(x).out
    with torch.no_grad():
        positions = torch.arange(LENGTH).expand(2, -1)
        full_only = layer._expert(0, x, positions, None, None, torch.ones(2, LENGTH, dtype=x.dtype), {},
                                  torch.zeros_like(x))[0]
    torch.testing.assert_close(out, full_only)
    assert not torch.allclose(layer(x).out, full_only)  # warm-up over: routed mixture


def test_kl_anneals_in_after_warmup_and_eta_anneal_waits_for_it():
    layer = make(warmup_steps=2, kl_anneal_steps=4, elbo_weight=2.0, train_eta=0.2, train_eta_start=1.0,
                 eta_anneal_steps=4).train()
    x = tokens()
    weights, etas, losses = [], [], []
    for _ in range(8):
        weights.append(layer.current_kl_weight())
        etas.append(layer.current_eta())
        result = layer(x)
        losses.append((result.aux_loss.item(), result.stats["kl"].item()))
    assert weights == pytest.approx([0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.0])
    assert etas[:2] == [None, None] and etas[2:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    for weight, (aux, kl) in zip(weights, losses, strict=True):
        assert aux == pytest.approx(weight * kl)


def test_schedule_counter_survives_a_checkpoint_round_trip():
    layer = make(warmup_steps=3, kl_anneal_steps=2).train()
    for _ in range(4):
        layer(tokens())
    restored = make(seed=5, warmup_steps=3, kl_anneal_steps=2).train()
    assert restored.in_warmup()
    restored.load_state_dict(layer.state_dict())
    assert int(restored.routing_step) == 4 and not restored.in_warmup()
    assert restored.current_kl_weight() == pytest.approx(0.5)


def test_rows_are_the_share_each_expert_computed_under_hard_routing():
    layer = make(eval_eta=0.0).eval()  # every token hard: each computes exactly one expert
    x = tokens()
    result = layer(x)
    with torch.no_grad():
        positions = torch.arange(LENGTH).expand(2, -1)
        choice = layer.router(x, positions).argmax(-1)
    for i, name in enumerate(EXPERTS):
        assert result.stats[f"rows_{name}"].item() == pytest.approx((choice == i).double().mean().item())
    assert sum(result.stats[f"rows_{name}"].item() for name in EXPERTS) == pytest.approx(1.0)


def test_share_qkv_uses_one_projection():
    shared = make(share_qkv=True)
    separate = make()
    assert len(shared.expert_qkv) == 1 and len(separate.expert_qkv) == 3
    assert sum(p.numel() for p in shared.parameters()) < sum(p.numel() for p in separate.parameters())
    assert torch.isfinite(shared(tokens()).out).all()


@pytest.mark.parametrize("options, message", [
    ({"gate": "entropy"}, "gate must be one of"),
    ({"eval_eta": 1.5}, "eval_eta must be in"),
    ({"costs": (1.0, 0.2)}, "one value per expert"),
    ({"prior": "flat"}, "prior must be one of"),
    ({"elbo_weight": -1.0}, "elbo_weight must be >= 0"),
    ({"eta_anneal_steps": -1}, "eta_anneal_steps"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"warmup_steps": 2.5}, "warmup_steps must be an integer >= 0"),
    ({"kl_anneal_steps": -3}, "kl_anneal_steps must be an integer >= 0"),
    ({"warmup_mixture": (0.5, 0.5)}, "warmup_mixture needs one non-negative weight"),
    ({"warmup_mixture": (0.5, 0.6, -0.1)}, "warmup_mixture needs one non-negative weight"),
    ({"warmup_mixture": (0.5, 0.5, 0.5)}, "warmup_mixture needs one non-negative weight"),
    ({"window": 0}, "window must be a positive integer"),
])
def test_bad_options_raise_value_errors(options, message):
    with pytest.raises(ValueError, match=message):
        build_attention("meta", dim=DIM, heads=HEADS, **options)


def test_dirichlet_gate_is_a_normalised_entropy():
    layer = make(gate="dirichlet_entropy").eval()
    positions = torch.arange(LENGTH).expand(2, -1)
    concentration = layer.router(tokens(), positions)
    certainty = layer.certainty(concentration)
    entropy = Dirichlet(concentration).entropy()
    torch.testing.assert_close(certainty, 1 - torch.exp(entropy - (-torch.tensor(2.0).log().double())))
    assert ((certainty >= 0) & (certainty <= 1)).all()  # 1 is reached only by exp underflow


def test_cached_decoding_runs_only_the_routed_expert():
    """Every token hard-routed (eval_eta=0): a decoding step computes queries, attention and output
    for its one expert; the others only take its keys/values (or state). Same outputs as the
    parallel pass, whose routing spreads over all three experts."""
    layer = make(eval_eta=0.0, position_scale=64.0).eval()
    x = tokens(length=20)[:1]
    positions = torch.arange(20)[None]
    calls = []
    queries = layer._queries

    def counting_queries(index, *args, **kwargs):
        calls.append(index)
        return queries(index, *args, **kwargs)

    layer._queries = counting_queries
    with torch.no_grad():
        parallel = layer(x).out
        calls.clear()
        cache, steps = {}, []
        for t in range(20):
            before = len(calls)
            steps.append(layer.decode(x[:, t:t + 1], positions=positions[:, t:t + 1], cache=cache))
            assert len(calls) - before == 1, f"token {t} ran {len(calls) - before} experts"
    assert len(set(calls)) == 3, "the test needs tokens routed to every expert"
    torch.testing.assert_close(torch.cat(steps, dim=1), parallel)


def test_hard_routing_skips_the_projections_of_unused_experts():
    """Every token hard-routed to the linear expert: the full and local experts project no keys,
    values or queries (their K/V/Q projections are what the skipped attention would have paid)."""
    layer = make(eval_eta=0.0).eval()
    with torch.no_grad():
        layer.router.increments.bias.copy_(torch.tensor([-20.0, 20.0, -20.0]))
    projected = []
    keys_values, queries = layer._keys_values, layer._queries
    layer._keys_values = lambda index, *a, **k: projected.append(("kv", index)) or keys_values(index, *a, **k)
    layer._queries = lambda index, *a, **k: projected.append(("q", index)) or queries(index, *a, **k)
    with torch.no_grad():
        result = layer(tokens())
    assert result.stats["rows_linear"] == 1 and result.stats["rows_full"] == 0
    assert sorted(projected) == [("kv", 1), ("q", 1)]


def test_forced_routing_runs_each_token_through_its_one_expert_at_the_given_shares():
    """force_routing (bench steps' trained-router shares): every token hard-routed, its output the
    chosen expert's alone, the share of tokens per expert as asked (to within the rounding of T)."""
    layer = make().train()
    shares = (0.3, 0.5, 0.2)
    layer.force_routing(shares)
    x = tokens(length=40)
    result = layer(x)
    positions = torch.arange(40).expand(2, -1)
    choice = layer._forced_choice(positions, positions)
    with torch.no_grad():
        alone = [layer._expert(i, x, positions, None, None, torch.ones(2, 40, dtype=x.dtype), {},
                               torch.zeros_like(x))[0] for i in range(len(EXPERTS))]
    expected = torch.stack(alone)[choice, torch.arange(2)[:, None], torch.arange(40)]
    torch.testing.assert_close(result.out, expected)
    assert float(result.stats["hard_fraction"]) == 1.0
    for index, name in enumerate(EXPERTS):
        assert float(result.stats[f"rows_{name}"]) == pytest.approx(shares[index], abs=2 / 40)
    layer.force_routing(None)
    assert float(layer(x).stats["hard_fraction"]) < 1.0  # the router's own routing again
    with pytest.raises(ValueError, match="one non-negative share per expert"):
        layer.force_routing((0.5, 0.6, -0.1))


def test_skip_schedules_puts_meta_past_its_warmup_and_annealing():
    from routeformer.attention.base import skip_schedules

    layer = make(warmup_steps=5, kl_anneal_steps=4, elbo_weight=2.0, train_eta=0.2,
                 eta_anneal_steps=4).train()
    assert layer.in_warmup() and layer.current_eta() is None
    skip_schedules(torch.nn.Sequential(layer))
    assert not layer.in_warmup()
    assert (layer.current_eta(), layer.current_kl_weight()) == (pytest.approx(0.2), 2.0)
