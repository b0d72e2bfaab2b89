"""Mixed precision for the training step: `train.precision` fp32 | bf16 | fp16.

bf16 runs the forward under `torch.autocast` in bfloat16 (CPU and CUDA; on CPUs with AVX-512 BF16
its matmuls are about 4x faster than fp32); its exponent range is fp32's, so it needs no scaler.
fp16 (CUDA only) adds a gradient scaler: its range would underflow small gradients. Parameters,
optimizer state and evaluation stay fp32 in every mode.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> None:
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision='fp16' needs a CUDA device (a gradient scaler on fp16 "
                         f"autocast); on {device.type} use 'bf16'")


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The context the forward pass runs in (a no-op for fp32)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision])


def gradient_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler, enabled for fp16 only (disabled, its calls pass straight through)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
