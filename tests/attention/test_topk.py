"""The `topk` (ADSR) layer: limits against full attention, router gradients, learning, options."""

import pytest
import torch

from routeformer.attention import build_attention
from routeformer.ops.full import masked_attention_reference
from routeformer.ops.native import native_kernels

DIM, HEADS = 32, 4


def make(seed=0, **options):
    torch.manual_seed(seed)
    return build_attention("topk", dim=DIM, heads=HEADS, causal=options.pop("causal", True), **options)


def copy_projections(source, target):
    target.qkv_proj.load_state_dict(source.qkv_proj.state_dict())
    target.out_proj.load_state_dict(source.out_proj.state_dict())


@pytest.mark.parametrize("causal", [True, False])
def test_with_k_covering_every_key_it_is_full_attention(causal):
    layer = make(topk=64, routing_learning="distill", causal=causal).eval()
    full = build_attention("full", dim=DIM, heads=HEADS, causal=causal).eval()
    copy_projections(layer, full)
    x = torch.randn(2, 19, DIM)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, 15:] = False
    with pytest.warns(UserWarning, match="every query reads all its eligible keys"):
        ours = layer(x, mask=mask)
    theirs = full(x, mask=mask)
    torch.testing.assert_close(ours.out[mask], theirs.out[mask], atol=1e-5, rtol=1e-5)
    assert ours.stats["routing_recall"].item() == pytest.approx(1.0)


@pytest.mark.filterwarnings("ignore:topk attention")  # K = 64 > T on purpose: full attention
def test_score_bias_adds_scaled_routing_scores_to_the_logits():
    layer = make(topk=64, routing_learning="score_bias", score_bias_scale=0.7, temperature=2.0).eval()
    x = torch.randn(1, 11, DIM)
    q, k, v = layer.project_qkv(x, torch.arange(11)[None])
    route_q, route_k = layer.router(x, torch.arange(11)[None])
    logits_bias = 0.35 * (route_q @ route_k.transpose(-1, -2))
    # q·k/√d + 0.35·s as one dot product of augmented vectors, scale 1
    q_aug = torch.cat([q * (DIM // HEADS) ** -0.5, 0.35 * route_q], -1)
    k_aug = torch.cat([k, route_k], -1)
    allowed = torch.ones(11, 11, dtype=torch.bool).tril()
    heads_out = masked_attention_reference(q_aug, k_aug, v, allowed, scale=1.0)
    expected = layer.out_proj(heads_out.transpose(1, 2).reshape(1, 11, DIM))
    torch.testing.assert_close(layer(x).out, expected, atol=1e-5, rtol=1e-5)
    assert logits_bias.abs().max() > 0.05, "the bias must be large enough to matter in this test"


@pytest.mark.parametrize("learning", ["score_bias", "distill"])
def test_learnable_routing_sends_gradient_to_the_router(learning):
    layer = make(topk=4, routing_learning=learning).train()
    result = layer(torch.randn(2, 24, DIM))
    (result.out.square().mean() + result.aux_loss).backward()
    router = dict(layer.router.named_parameters())
    assert router, "the router must have parameters"
    for name, param in router.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    if learning == "distill":
        assert result.aux_loss.item() > 0


def test_fixed_random_routing_has_no_router_parameters():
    layer = make(topk=4, routing_learning="none").train()
    assert not list(layer.router.parameters())
    assert "router.random_weight" in layer.state_dict()
    result = layer(torch.randn(2, 24, DIM))
    assert result.aux_loss.item() == 0.0


@pytest.mark.parametrize("options", [{}, {"distill_queries": 12}, {"distill_dense_steps": 30}],
                         ids=["every-row", "sampled-rows", "dense-warm-up"])
def test_distillation_makes_routing_recall_improve(options):
    """Only the router trains (the attention it imitates is frozen): recall, probed at evaluation,
    must rise, with the loss on every row, on sampled rows, or after a dense warm-up."""
    torch.manual_seed(0)
    layer = make(topk=4, routing_learning="distill", routing_dim=8, recall_queries=48, **options)
    for param in [*layer.qkv_proj.parameters(), *layer.out_proj.parameters()]:
        param.requires_grad_(False)
    optimizer = torch.optim.Adam(layer.router.parameters(), lr=1e-2)
    data = torch.randn(8, 48, DIM, generator=torch.Generator().manual_seed(1))

    def recall():
        with torch.no_grad():
            return layer.eval()(data).stats["routing_recall"].item()

    before = recall()
    for _ in range(60):
        result = layer.train()(data)
        assert "routing_recall" not in result.stats  # the probe runs at evaluation only
        optimizer.zero_grad()
        result.aux_loss.backward()
        optimizer.step()
    assert recall() > before + 0.05


def test_exploration_slots_only_in_training():
    layer = make(topk=8, exploration=0.25)
    x = torch.randn(1, 40, DIM)
    train_keys = layer.train()(x).stats["selected_keys"].item()
    eval_keys = layer.eval()(x).stats["selected_keys"].item()
    assert eval_keys == pytest.approx(sum(min(8, i + 1) for i in range(40)) / 40)
    assert train_keys <= eval_keys + 1e-6  # 6 routed + 2 random, duplicates dropped


def test_shared_routing_uses_one_key_set_for_all_heads():
    shared = make(topk=4, shared_routing=True).eval()
    separate = make(topk=4).eval()
    x = torch.randn(1, 30, DIM)
    assert shared(x).stats["head_overlap"].item() == 1.0
    assert separate(x).stats["head_overlap"].item() < 1.0


def test_entropy_regulariser_enters_the_aux_loss():
    layer = make(topk=4, entropy_weight=0.5).train()
    result = layer(torch.randn(1, 20, DIM))
    assert result.aux_loss.item() < 0  # -w·H with H > 0
    layer.eval()
    assert layer(torch.randn(1, 20, DIM)).aux_loss.item() == 0.0


def test_flops_count_routing_and_attention(monkeypatch):
    monkeypatch.setenv("ROUTEFORMER_NATIVE", "0")  # the PyTorch ops' block accounting (see test_topk_ops)
    layer = make(topk=4, routing_learning="distill", block=32, dense_below=0).eval()
    stats = layer(torch.randn(1, 256, DIM)).stats
    attention = 2 * 1 * HEADS * 256 * 4 * (2 * (DIM // HEADS))
    assert stats["flops"].item() == stats["routing_flops"].item() + attention
    # causal: query block b scores only keys up to its end, 32·(32 + 64 + ... + 256) per head
    scored = sum(32 * 32 * (b + 1) for b in range(8))
    # routing space: r = 16 dims plus the recency dim of the default routing_positions
    assert stats["routing_flops"].item() == 2 * (16 + 1) * HEADS * scored


@pytest.mark.parametrize("learning", ["score_bias", "distill"])
def test_dense_short_path_equals_the_gathered_path(learning):
    gathered = make(topk=5, routing_learning=learning, dense_below=0, local_window=2).train()
    dense = make(topk=5, routing_learning=learning, dense_below=1024, local_window=2).train()
    dense.load_state_dict(gathered.state_dict())
    x = torch.randn(2, 30, DIM)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, 25:] = False
    results = [layer(x, mask=mask) for layer in (gathered, dense)]
    torch.testing.assert_close(results[0].out[mask], results[1].out[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0].aux_loss, results[1].aux_loss)
    grads = []
    for layer, result in zip((gathered, dense), results, strict=True):
        (result.out[mask].square().sum() + result.aux_loss).backward()
        grads.append({n: p.grad for n, p in layer.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "options, message",
    [({"routing_learning": "lsh"}, "routing_learning must be one of"),
     ({"topk": 0}, "topk must be a positive integer"),
     ({"exploration": 1.0}, "exploration must be a fraction"),
     ({"temperature": 0.0}, "temperature must be > 0"),
     ({"local_window": -1}, "local_window must be an integer >= 0"),
     ({"routing_learning": "none", "entropy_weight": 0.1}, "entropy_weight needs a learnable router")],
)
def test_bad_options_raise_value_errors(options, message):
    with pytest.raises(ValueError, match=message):
        make(**options)


def test_dense_path_limit_follows_the_implementation_unless_set():
    from routeformer.attention.topk import DENSE_BELOW_NATIVE, DENSE_BELOW_TORCH
    from routeformer.ops.native import native_enabled

    q = torch.randn(1, 2, 8, 4)
    with native_enabled(False):
        assert make(topk=4).dense_limit(q, q, q) == DENSE_BELOW_TORCH
        assert make(topk=4, dense_below=7).dense_limit(q, q, q) == 7
    expected = DENSE_BELOW_NATIVE if native_kernels(q) is not None else DENSE_BELOW_TORCH
    assert make(topk=4).dense_limit(q, q, q) == expected
    with pytest.raises(ValueError, match="dense_below"):
        make(topk=4, dense_below=-1)


def _position_only_router(layer, routing_dim=16):
    """Router weights that give every token the same routing vector, nonzero only in rotary pair 1
    (angle 10000^(-1/8) ≈ 0.32 rad per position): the content score ties everywhere, so only the
    position term can order keys."""
    weight = torch.zeros_like(layer.router.net.weight)
    routing_heads = weight.shape[0] // (2 * routing_dim)
    for side in range(2):
        for head in range(routing_heads):
            weight[(side * routing_heads + head) * routing_dim + 2, 0] = 1.0
    with torch.no_grad():
        layer.router.net.weight.copy_(weight)
        if hasattr(layer.router, "recency_logit"):
            layer.router.recency_logit.fill_(0.0)


@pytest.mark.parametrize("positions, expected", [
    ("none", lambda i: set(range(min(3, i + 1)))),                 # ties: the lowest indices
    ("rotary", lambda i: set(range(max(0, i - 2), i + 1))),        # cos(0.32·(i − j)) peaks at j = i
    ("recency", lambda i: set(range(max(0, i - 2), i + 1))),       # −β·(i − j)
    ("rotary+recency", lambda i: set(range(max(0, i - 2), i + 1))),
])
def test_routing_positions_order_keys_by_offset(positions, expected):
    """Equal tokens everywhere (T = 10): a position-blind router cannot tell keys apart and takes
    the lowest indices; rotary and recency routing select the nearest keys."""
    from routeformer.ops.topk import route_topk, slot_membership

    layer = make(topk=3, routing_positions=positions).eval()
    _position_only_router(layer)
    x = torch.zeros(1, 10, DIM)
    x[..., 0] = 1.0
    route_q, route_k = layer.router(x, torch.arange(10)[None])
    index, valid, _ = route_topk(route_q, route_k, 3, causal=True)
    member = slot_membership(index, valid, 10)[0, 0]
    for i in range(10):
        assert set(member[i].nonzero().flatten().tolist()) == expected(i), (positions, i)


def test_rotary_routing_scores_depend_on_offset_only():
    layer = make(topk=3, routing_positions="rotary").eval()
    x = torch.randn(1, 12, DIM)
    rq, rk = layer.router(x, torch.arange(12)[None])
    rq_shift, rk_shift = layer.router(x, torch.arange(12)[None] + 37)
    torch.testing.assert_close(rq @ rk.transpose(-1, -2), rq_shift @ rk_shift.transpose(-1, -2),
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(rq, rq_shift), "the positions must reach the routing vectors"


def test_recency_slope_learns_through_the_distillation_loss():
    layer = make(topk=4, routing_positions="recency").train()
    result = layer(torch.randn(2, 24, DIM))
    result.aux_loss.backward()
    assert layer.router.recency_logit.grad is not None and layer.router.recency_logit.grad.abs().sum() > 0


def test_recency_init_sets_the_starting_slope_and_the_default_is_unchanged():
    import torch.nn.functional as F

    default = make(topk=4, routing_positions="recency")
    logit = default.router.recency_logit.detach()
    assert torch.equal(logit, torch.full_like(logit, -3.0))
    for slope in (1e-4, 0.05, 2.0):
        layer = make(topk=4, routing_positions="recency", recency_init=slope)
        torch.testing.assert_close(F.softplus(layer.router.recency_logit.detach()),
                                   torch.full_like(layer.router.recency_logit, slope), rtol=1e-5, atol=0)
    for bad in (0, -1.0, 60.0, True, "0.1"):
        with pytest.raises(ValueError, match=r"recency_init must be a slope in \(0, 50\) or None"):
            make(topk=4, recency_init=bad)


def test_temperature_leaves_the_selection_and_scales_the_router_distribution():
    x = torch.randn(2, 40, DIM)
    cold, hot = make(topk=4, temperature=0.5), make(topk=4, temperature=2.0)
    hot.load_state_dict(cold.state_dict())
    torch.testing.assert_close(cold.eval()(x).out, hot.eval()(x).out)  # same keys, same output
    assert cold.train()(x).aux_loss.item() != pytest.approx(hot.train()(x).aux_loss.item(), rel=1e-3)


def test_exploration_with_one_slot_keeps_it_routed():
    layer = make(topk=1, exploration=0.6).train()
    result = layer(torch.randn(2, 20, DIM))
    assert result.stats["selected_keys"].item() == pytest.approx(1.0)  # min(round(0.6), K - 1) = 0 random
    layer = make(topk=4, exploration=0.6).train()
    assert layer(torch.randn(2, 20, DIM)).out.isfinite().all()  # 2 routed + 2 random slots


def test_flops_count_forced_keys_on_top_of_the_routed_ones():
    layer = make(topk=4, local_window=3, global_tokens=2, dense_below=0).eval()
    stats = layer(torch.randn(1, 64, DIM)).stats
    attention = 2 * 1 * HEADS * 64 * (4 + 3 + 2) * (2 * (DIM // HEADS))
    assert stats["flops"].item() == stats["routing_flops"].item() + attention
    # Query i reads min(K + w + g, i + 1) distinct keys (causal).
    assert stats["selected_keys"].item() == pytest.approx(sum(min(9, i + 1) for i in range(64)) / 64)


def test_more_slots_than_keys_warns_once_per_layer():
    layer = make(topk=6, local_window=2).eval()
    with pytest.warns(UserWarning, match="exceeds the 7 keys"):
        layer(torch.randn(1, 7, DIM))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(torch.randn(1, 5, DIM))  # warned already
        make(topk=6, local_window=2).eval()(torch.randn(1, 8, DIM))  # 8 slots fit 8 keys
