"""topk's routing loss (attention/topk_distill.py) against its reference, the detached router, the
dense warm-up and its counter, and the options' errors."""

import pytest
import torch

from routeformer.attention import build_attention, topk_distill
from routeformer.attention.topk_distill import routing_loss, routing_loss_reference, sample_rows
from routeformer.ops.topk import route_topk

B, H, T, D_HEAD, R_DIM = 2, 3, 37, 8, 5


def inputs(routing_heads, causal, masked, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, D_HEAD, generator=generator, dtype=torch.float64) for _ in range(2))
    route_q, route_k = (torch.randn(B, routing_heads, T, R_DIM, generator=generator, dtype=torch.float64)
                        for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, 29:] = False
        mask[0, 3] = False
    index, valid, _ = route_topk(route_q, route_k, 6, causal=causal, key_mask=mask)
    return q, k, route_q.requires_grad_(), route_k.requires_grad_(), index, valid, mask


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "padded"])
@pytest.mark.parametrize("routing_heads", [H, 1], ids=["per-head", "shared"])
@pytest.mark.parametrize("sampled", [False, True], ids=["every-row", "sampled"])
@pytest.mark.parametrize("row_products", [True, False], ids=["row-products", "slot-gathers"])
def test_routing_loss_matches_the_reference_in_value_and_gradient(
    dense, causal, masked, routing_heads, sampled, row_products, monkeypatch
):
    # the sparse scores from dense row products and a gather, or from per-slot gathers
    monkeypatch.setattr(topk_distill, "DENSE_ROW_SCORES", T * T if row_products else 0)
    q, k, route_q, route_k, index, valid, mask = inputs(routing_heads, causal, masked)
    rows = torch.tensor([0, 3, 4, 17, 30, 36]) if sampled else None
    options = dict(causal=causal, rows=rows, dense=dense, temperature=1.7, distill_weight=0.8,
                   entropy_weight=0.3)
    ours, flops = routing_loss(q, k, route_q, route_k, index, valid, mask, **options)
    grads = torch.autograd.grad(ours, (route_q, route_k))
    theirs = routing_loss_reference(q, k, route_q, route_k, index, valid, mask, **options)
    expected = torch.autograd.grad(theirs, (route_q, route_k))
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    assert grads[1].abs().sum() > 0
    count = T if rows is None else rows.numel()
    keys = T if dense or row_products else index.shape[-1]
    assert flops == 2 * B * count * keys * (routing_heads * R_DIM + H * D_HEAD)


def test_sampled_rows_are_distinct_sorted_and_cover_when_asked():
    torch.manual_seed(3)
    rows = sample_rows(100, 16, torch.device("cpu"))
    assert rows.numel() == 16 and rows.unique().numel() == 16
    assert torch.equal(rows, rows.sort().values) and int(rows.max()) < 100
    assert sample_rows(10, 16, torch.device("cpu")) is None
    assert sample_rows(10, None, torch.device("cpu")) is None
    # an unbiased estimate: every row is drawn, over many calls, about equally often
    counts = torch.zeros(100)
    for _ in range(400):
        counts[sample_rows(100, 16, torch.device("cpu"))] += 1
    assert counts.min() > 30 and counts.max() < 100  # expected 64 each


def _layer(**options):
    torch.manual_seed(0)
    return build_attention("topk", dim=24, heads=2, causal=True, topk=4, **options).train()


@pytest.mark.parametrize("detach", [True, False])
def test_the_routing_loss_reaches_the_backbone_only_when_coupled(detach):
    layer = _layer(detach_router_input=detach)
    x = torch.randn(2, 40, 24, requires_grad=True)
    result = layer(x)
    result.aux_loss.backward()
    router_grad = sum(p.grad.abs().sum() for p in layer.router.parameters() if p.grad is not None)
    assert router_grad > 0  # the routing loss always trains the router
    backbone = 0.0 if x.grad is None else float(x.grad.abs().sum())
    if detach:
        assert backbone == 0.0
        assert all(p.grad is None for p in [*layer.qkv_proj.parameters(), *layer.out_proj.parameters()])
    else:
        assert backbone > 0


def test_the_task_loss_still_reaches_the_backbone_with_a_detached_router():
    layer = _layer()
    x = torch.randn(2, 40, 24, requires_grad=True)
    layer(x).out.square().sum().backward()
    assert x.grad.abs().sum() > 0


def test_dense_warm_up_covers_every_eligible_key_for_its_steps_then_stops():
    layer = _layer(distill_dense_steps=2, distill_queries=None)
    sparse = _layer(distill_queries=None)
    x = torch.randn(2, 40, 24)
    warm = [layer(x).aux_loss.item() for _ in range(3)]
    plain = sparse(x).aux_loss.item()
    assert int(layer.distill_step) == 3
    assert warm[0] == warm[1] != pytest.approx(plain, rel=1e-4)  # dense KL: another support
    assert warm[2] == pytest.approx(plain, rel=1e-6)  # after the warm-up: the sparse KL over R_i
    layer.eval()(x)
    assert int(layer.distill_step) == 3  # evaluation calls are not training steps
    restored = _layer(distill_dense_steps=2, distill_queries=None)
    restored.load_state_dict(layer.state_dict())
    assert int(restored.distill_step) == 3 and not restored.distilling_densely()


@pytest.mark.parametrize("options, message", [
    ({"distill_queries": 0}, "distill_queries"),
    ({"distill_queries": 2.5}, "distill_queries"),
    ({"distill_dense_steps": -1}, "distill_dense_steps"),
    ({"distill_dense_steps": 10, "routing_learning": "score_bias"}, "distill_dense_steps"),
])
def test_bad_distillation_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        build_attention("topk", dim=24, heads=2, causal=True, **options)
