"""Full softmax attention (the `full` expert).

op.py: the fast path (`full_attention`, SDPA; O(T) memory under a padding mask) and its FLOP count;
reference.py: the naive twin (`full_attention_reference`) and `masked_attention_reference`, the
masked softmax that the other ops' references build on. The native C kernels and the Triton
kernels stay in ops/native/ and ops/triton/ (the C build depends on their paths)."""

from routeformer.ops.full.op import full_attention, full_attention_flops, sdpa_allowed
from routeformer.ops.full.reference import allowed_keys, full_attention_reference, masked_attention_reference

__all__ = [
    "allowed_keys",
    "full_attention",
    "full_attention_flops",
    "full_attention_reference",
    "masked_attention_reference",
    "sdpa_allowed",
]
