"""Linear attention with the elu(x) + 1 feature map (the `linear` expert).

op.py: the chunked PyTorch fast path, the dispatch to the C kernels (ops/native/linear.py) and
the FLOP count; reference.py: the naive twin (the dense O(T²) sum). The native C kernels stay in
ops/native/ (the C build depends on their paths)."""

from routeformer.ops.linear.op import exclusive_chunk_prefix, linear_attention, linear_attention_flops
from routeformer.ops.linear.reference import (
    DEFAULT_EPS,
    feature_map,
    linear_attention_reference,
    masked_features,
)

__all__ = [
    "DEFAULT_EPS",
    "exclusive_chunk_prefix",
    "feature_map",
    "linear_attention",
    "linear_attention_flops",
    "linear_attention_reference",
    "masked_features",
]
