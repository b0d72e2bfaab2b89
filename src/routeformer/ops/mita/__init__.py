"""MiTA: compress-and-route attention with landmark queries and top-k deformable experts.

op.py: `mita_attention` (bidirectional and causal) and its dispatch to the C kernels; landmarks.py:
the landmark stage; experts.py: the expert parts and their merge; decode.py: cached decoding of
causal MiTA; checks.py: the argument check; reference.py: the naive twins (`mita_reference`,
`landmark_attention_reference`). The native C kernels (ops/native/mita.py, ops/native/mita_train.py)
and the Triton kernels (ops/triton/mita.py) stay in ops/native/ and ops/triton/ (the C build
depends on their paths)."""

from routeformer.ops.mita.checks import check_mita_args, grid_pool_shape
from routeformer.ops.mita.decode import mita_decode
from routeformer.ops.mita.landmarks import landmark_attention
from routeformer.ops.mita.op import DEFAULT_BLOCK, DEFAULT_PACK, MitaResult, mita_attention
from routeformer.ops.mita.reference import landmark_attention_reference, mita_reference

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_PACK",
    "MitaResult",
    "check_mita_args",
    "grid_pool_shape",
    "landmark_attention",
    "landmark_attention_reference",
    "mita_attention",
    "mita_decode",
    "mita_reference",
]
