"""Top-k routing by groups of equal routing keys (ops/topk/repeated.py): the reference's selection
wherever it applies, and None (route as usual) where it does not."""

import pytest
import torch

from routeformer.ops import route_topk, route_topk_reference
from routeformer.ops.topk import slot_membership
from routeformer.ops.topk.repeated import REPEATED_KEYS_MIN, route_repeated_keys


def _token_vectors(length, distinct, integers, generator, heads=2, batch=2, dim=16):
    """Routing vectors that are a function of the token, as a position-blind router's first layer."""
    tokens = torch.randint(0, distinct, (batch, length), generator=generator)
    if integers:  # small integers score exactly: distinct vectors often tie
        tables = [torch.randint(-2, 3, (distinct, dim), generator=generator).float() for _ in range(2)]
    else:
        tables = [torch.randn(distinct, dim, generator=generator) for _ in range(2)]
    return [table[tokens].unsqueeze(1).expand(batch, heads, length, dim).contiguous() for table in tables]


@pytest.mark.parametrize("integers", [False, True])
@pytest.mark.parametrize("local_window, global_tokens, masked", [(0, 0, False), (6, 3, True), (0, 2, False)])
def test_groups_select_what_the_reference_selects(integers, local_window, global_tokens, masked):
    """Integer vectors make distinct groups tie on many queries (their cut is re-selected densely);
    float vectors almost never do. Both must give the reference's sets."""
    gen = torch.Generator().manual_seed(3)
    route_q, route_k = _token_vectors(REPEATED_KEYS_MIN + 200, 12, integers, gen)
    key_mask = torch.rand(2, route_k.shape[2], generator=gen) > 0.1 if masked else None
    routed = route_repeated_keys(route_q, route_k, 40, key_mask, local_window, global_tokens)
    assert routed is not None
    index, valid, scored = routed
    assert scored == 2 * 2 * route_q.shape[2] * 12
    expected = route_topk_reference(route_q.double(), route_k.double(), 40, causal=True, key_mask=key_mask,
                                    local_window=local_window, global_tokens=global_tokens)
    assert torch.equal(slot_membership(index, valid, route_k.shape[2]), expected)
    assert (slot_membership(index, valid, route_k.shape[2]).sum(-1) == valid.sum(-1)).all()  # distinct


def test_route_topk_takes_the_groups_and_matches_its_kernels():
    gen = torch.Generator().manual_seed(4)
    route_q, route_k = _token_vectors(2048, 15, False, gen)
    grouped = route_topk(route_q, route_k, 64)
    assert grouped[2] == 2 * 2 * 2048 * 15  # the groups' score count: the grouped path ran
    kernel = route_topk(route_q, route_k, 64, position_dim=True)  # skips the grouping
    assert grouped[2] != kernel[2]
    assert torch.equal(slot_membership(grouped[0], grouped[1], 2048),
                       slot_membership(kernel[0], kernel[1], 2048))


def test_bfloat16_vectors_are_grouped_as_stored():
    gen = torch.Generator().manual_seed(5)
    route_q, route_k = (x.bfloat16() for x in _token_vectors(REPEATED_KEYS_MIN, 10, False, gen))
    index, valid, _ = route_repeated_keys(route_q, route_k, 32, None, 0, 0)
    expected = route_topk_reference(route_q.double(), route_k.double(), 32, causal=True)
    assert torch.equal(slot_membership(index, valid, route_k.shape[2]), expected)


def test_declines_where_it_does_not_apply():
    gen = torch.Generator().manual_seed(6)
    distinct_q, distinct_k = (torch.randn(1, 1, 2048, 8, generator=gen) for _ in range(2))
    assert route_repeated_keys(distinct_q, distinct_k, 16, None, 0, 0) is None  # keys do not repeat
    route_q, route_k = _token_vectors(REPEATED_KEYS_MIN - 1, 5, False, gen)
    assert route_repeated_keys(route_q, route_k, 16, None, 0, 0) is None  # short
    route_q, route_k = _token_vectors(REPEATED_KEYS_MIN, 5, False, gen)
    route_k[0, 0, 7, 0] = float("nan")
    assert route_repeated_keys(route_q, route_k, 16, None, 0, 0) is None  # not finite
    many_q, many_k = _token_vectors(8192, 300, False, gen, heads=1, batch=1)
    assert route_repeated_keys(many_q, many_k, 16, None, 0, 0) is None  # > 256 groups


def _vectors_of_tokens(tokens, dim=8, seed=7):
    """Routing keys and queries [1, 1, T, dim] that are a function of the given token row."""
    gen = torch.Generator().manual_seed(seed)
    tables = [torch.randn(int(tokens.max()) + 1, dim, generator=gen) for _ in range(2)]
    return [table[tokens].view(1, 1, -1, dim) for table in tables]


def test_the_group_limit_holds_exactly_before_and_after_the_cheap_prefix_check():
    """At S = 2048 a row may hold 2048 // 16 = 128 distinct keys. The first 4 x 129 keys are checked
    before the whole row (a cheap refusal): a row at the limit is grouped, one past it is not —
    whether the extra key is inside that prefix or after it."""
    gen = torch.Generator().manual_seed(8)
    at_limit = torch.cat([torch.arange(128), torch.randint(0, 128, (2048 - 128,), generator=gen)])
    assert route_repeated_keys(*_vectors_of_tokens(at_limit), 16, None, 0, 0) is not None
    early = at_limit.clone()
    early[200] = 128  # the 129th distinct key, inside the prefix
    assert route_repeated_keys(*_vectors_of_tokens(early), 16, None, 0, 0) is None
    late = at_limit.clone()
    late[2000] = 128  # ... after it: the whole row's count refuses it
    assert route_repeated_keys(*_vectors_of_tokens(late), 16, None, 0, 0) is None
