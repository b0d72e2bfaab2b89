"""Pure attention functions on q, k, v [B, H, T, d]; every fast path has a `*_reference` twin.

The main ops live one package each, fla-style: ops/full, ops/local, ops/linear, ops/topk, ops/mita
and ops/expanding hold the op's PyTorch fast path and dispatch, and its naive twin in reference.py,
which imports no fast path (tests/ops/test_references_independent.py). The C kernels and their
loaders stay in ops/native/ and the Triton kernels in ops/triton/ (the C build depends on their
paths); shared pieces (backends, attention_lse, block_attention, padded_keys, flops, ...) are
modules here.

Which kernels run each op (Triton, the native C kernels, or PyTorch) is decided in one place,
ops/backends.py; `force_backend("torch" | "native" | "triton")` forces one for a block."""

from routeformer.ops.attention_lse import attention_with_lse, attention_with_lse_reference, merge_partials
from routeformer.ops.backends import force_backend
from routeformer.ops.block_attention import block_attention, block_attention_reference
from routeformer.ops.expanding import expanding_attention, expanding_attention_reference
from routeformer.ops.full import full_attention, full_attention_flops, full_attention_reference
from routeformer.ops.linear import (
    linear_attention,
    linear_attention_flops,
    linear_attention_reference,
)
from routeformer.ops.local import local_attention, local_attention_flops, local_attention_reference
from routeformer.ops.mita import mita_attention, mita_reference
from routeformer.ops.multihop import multihop_attention, multihop_attention_reference
from routeformer.ops.rotary import apply_rotary, rotary_angles
from routeformer.ops.topk import (
    add_random_slots,
    gathered_dot,
    gathered_dot_reference,
    route_topk,
    route_topk_reference,
    routed_attention,
    routed_attention_reference,
)

__all__ = [
    "add_random_slots",
    "gathered_dot",
    "gathered_dot_reference",
    "route_topk",
    "route_topk_reference",
    "routed_attention",
    "routed_attention_reference",
    "apply_rotary",
    "attention_with_lse",
    "attention_with_lse_reference",
    "block_attention",
    "block_attention_reference",
    "expanding_attention",
    "expanding_attention_reference",
    "force_backend",
    "full_attention",
    "full_attention_flops",
    "full_attention_reference",
    "linear_attention",
    "linear_attention_flops",
    "linear_attention_reference",
    "local_attention",
    "local_attention_flops",
    "local_attention_reference",
    "merge_partials",
    "mita_attention",
    "mita_reference",
    "multihop_attention",
    "multihop_attention_reference",
    "rotary_angles",
]
