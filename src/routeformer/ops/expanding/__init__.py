"""Expanding attention: a geometric prior over edge distance whose window is inferred per query.

op.py: `expanding_attention` (the band path) and its dispatch to the C kernels and the Triton final
pass; band.py: the band path's ring cache and final pass; prior.py: the prior's pure math and
stopping rule (shared by all paths); decode.py: cached decoding; reference.py: the naive twin
(`expanding_attention_reference`) and the window inference it shares with cached decoding. The
native C kernels (ops/native/band.py, expanding_kernels.c) and the Triton kernel
(ops/triton/band.py) stay in ops/native/ and ops/triton/ (the C build depends on their paths)."""

from routeformer.ops.expanding.decode import expanding_decode
from routeformer.ops.expanding.op import (
    DEFAULT_BLOCK,
    UPDATES,
    ExpandingOutput,
    expanding_attention,
    expanding_uses_native,
)
from routeformer.ops.expanding.prior import check_expanding_options, geometric_horizon
from routeformer.ops.expanding.reference import WindowInference, expanding_attention_reference

__all__ = [
    "DEFAULT_BLOCK",
    "UPDATES",
    "ExpandingOutput",
    "WindowInference",
    "check_expanding_options",
    "expanding_attention",
    "expanding_attention_reference",
    "expanding_decode",
    "expanding_uses_native",
    "geometric_horizon",
]
