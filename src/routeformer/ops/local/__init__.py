"""Sliding-window attention (the `local` expert).

op.py: the blockwise PyTorch fast path, the dispatch to the C kernel (ops/native/local.py) and
the FLOP counts; reference.py: the naive twin (dense scores, band mask). The native C kernels and
the Triton kernels stay in ops/native/ and ops/triton/ (the C build depends on their paths)."""

from routeformer.ops.local.op import (
    NATIVE_ROWS,
    default_block,
    in_window,
    local_attention,
    local_attention_flops,
    local_kernel_serves_cpu,
)
from routeformer.ops.local.reference import local_attention_reference, local_band

__all__ = [
    "NATIVE_ROWS",
    "default_block",
    "in_window",
    "local_attention",
    "local_attention_flops",
    "local_attention_reference",
    "local_band",
    "local_kernel_serves_cpu",
]
