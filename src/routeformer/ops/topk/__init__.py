"""Top-k routing (ADSR): select keys in a cheap low-dimensional routing space, then attend exactly
over the gathered keys.

routing.py: the routing selection (`route_topk`, `add_random_slots`) and its dispatch to the C and
Triton kernels; gathered.py: attention and dot products over the gathered keys; decode.py: cached
one-token routing; slots.py: the argument check and slot count (shared with the Triton kernel);
reference.py: the naive twins. The native C kernels (ops/native/topk.py) and the Triton kernels
(ops/triton/topk_routing.py, ops/triton/gathered.py) stay in ops/native/ and ops/triton/ (the C
build depends on their paths)."""

from routeformer.ops.topk.decode import append_routing_keys, cached_routing_keys, route_cached
from routeformer.ops.topk.gathered import flat_rows, gathered_dot, routed_attention
from routeformer.ops.topk.reference import (
    gathered_dot_reference,
    route_topk_reference,
    routed_attention_reference,
    slot_membership,  # the mask of the routed keys, defined once
)
from routeformer.ops.topk.routing import DEFAULT_ROUTING_BLOCK, add_random_slots, route_topk
from routeformer.ops.topk.slots import check_routing, routing_slots

__all__ = [
    "DEFAULT_ROUTING_BLOCK",
    "add_random_slots",
    "append_routing_keys",
    "cached_routing_keys",
    "check_routing",
    "flat_rows",
    "gathered_dot",
    "gathered_dot_reference",
    "route_cached",
    "route_topk",
    "route_topk_reference",
    "routed_attention",
    "routed_attention_reference",
    "routing_slots",
    "slot_membership",
]
