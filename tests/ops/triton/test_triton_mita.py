"""MiTA's routed experts on the Triton kernel against the CPU op `routed_parts` (packed SDPA)."""

import pytest
import torch

from routeformer.ops.attention_lse import attention_with_lse_reference, merge_partials
from routeformer.ops.mita.experts import routed_parts
from routeformer.ops.triton.lse_merge import triton_merge_partials
from routeformer.ops.triton.mita import triton_routed_parts
from tests.ops.triton._checks import assert_same_gradients


def expert_inputs(device, routes, seed=0, dtype=torch.float32):
    batch, heads, length, experts, width, dim = 2, 2, 13, 4, 3, 8
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()
    q = make(batch, heads, length, dim)
    keys, values = make(batch, heads, experts, width, dim), make(batch, heads, experts, width, dim)
    expert_valid = torch.rand(batch, heads, experts, width, generator=generator) > 0.2
    expert_valid[0, 0, 1] = False  # an expert with no key: its queries get no weight from it
    assignment = torch.rand(batch, heads, length, experts, generator=generator).topk(routes, dim=-1).indices
    slot_valid = torch.rand(batch, heads, length, routes, generator=generator) > 0.1
    on = lambda t: t.to(device)
    return q, keys, values, on(expert_valid), on(assignment), on(slot_valid)


@pytest.mark.parametrize("routes", [1, 2])
def test_routed_parts_match_the_cpu_op_values_gradients_and_counts(device, routes):
    q, keys, values, expert_valid, assignment, slot_valid = expert_inputs(device, routes)
    scale = 0.35

    # As in MiTA, the slots are merged with a part that always has keys (the shared expert's
    # landmarks; here 3 keys per batch and head): a slot with no valid key then has no weight.
    def merged(fn, merge):
        shared = attention_with_lse_reference(q, keys[:, :, 0], values[:, :, 1], scale=scale)
        out, lse, flops, counts = fn(q, keys, values, expert_valid, assignment, slot_valid, scale)
        parts = [shared, *((out[:, :, :, r], lse[:, :, :, r]) for r in range(routes))]
        return merge(parts), out, lse, counts

    got, got_out, got_lse, got_counts = merged(triton_routed_parts, triton_merge_partials)
    want, want_out, want_lse, want_counts = merged(
        lambda *args: routed_parts(*args, pack=4), merge_partials)
    live = slot_valid[..., None] & (want_lse > -1e29)[..., None]
    torch.testing.assert_close(got_out * live, want_out * live, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_counts, want_counts)
    weight = torch.randn_like(want)
    assert_same_gradients(got, want, weight, (q, keys, values))


def test_bad_shapes_raise_value_errors(device):
    q, keys, values, expert_valid, assignment, slot_valid = expert_inputs(device, 1)
    with pytest.raises(ValueError, match="expert_keys"):
        triton_routed_parts(q, keys[..., :2, :], values, expert_valid, assignment, slot_valid, 1.0)
    with pytest.raises(ValueError, match="assignment"):
        triton_routed_parts(q, keys, values, expert_valid, assignment[..., :5, :], slot_valid, 1.0)
