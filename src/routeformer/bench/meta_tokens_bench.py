"""`routeformer bench meta_tokens`: the packed meta-attention against causal SDPA and against the
paper's dense-mask implementation.

Each sequence gets meta-tokens at `density` (seeded, uniform positions, as pre-training injects
them). The packed op's timing includes finding and packing the meta positions, as the layer pays
it on every call. Target: at most 1.03× causal SDPA at T = 4096, density 0.1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from routeformer.ops.meta_tokens import (
    meta_token_attention,
    meta_token_attention_dense_mask,
    pack_meta_positions,
)
from routeformer.tasks.meta_tokens import random_meta_slots


def random_meta_mask(batch: int, length: int, density: float, seed: int = 0) -> torch.Tensor:
    """bool [B, T] with round(density · T) meta positions per sequence."""
    return random_meta_slots(batch, length, density, torch.Generator().manual_seed(seed))


def meta_tokens_op_table(batch: int, density: float, dense_mask_up_to: int = 8192
                         ) -> Callable[[int], dict[str, Callable]]:
    def table(length: int) -> dict[str, Callable]:
        meta = random_meta_mask(batch, length, density, seed=length)
        ops = {
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            f"meta_tokens packed (ρ={density})": lambda q, k, v: meta_token_attention(
                q, k, v, pack_meta_positions(meta)),
        }
        if length <= dense_mask_up_to:  # T² mask memory
            ops[f"meta_tokens dense mask (ρ={density}, paper)"] = lambda q, k, v: (
                meta_token_attention_dense_mask(q, k, v, meta))
        return ops
    return table
