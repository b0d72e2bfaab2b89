"""Helpers shared by the Triton kernel files: the launcher that picks compiled or interpreted
kernels by device, argument checks and block sizes.

`triton` is imported here, so only the kernel files import this module (lazily, from `dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from torch import Tensor


def next_power_of_2(value: int) -> int:
    """The smallest power of two >= value (and >= 1): Triton's block shapes are powers of two."""
    return 1 << max(0, int(value) - 1).bit_length()


@contextmanager
def _nested_jit_interpreted() -> Iterator[None]:
    """Let an interpreted kernel call `@triton.jit` library functions (tl.sum, tl.max, tl.sort...)
    that were compiled-mode objects because `triton` was imported without TRITON_INTERPRET (as
    torch.compile does): for the launch, a compiled-mode function called from inside the kernel
    runs as Triton's interpreter would run it."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    interpreted: dict[Callable, InterpretedFunction] = {}

    def call(self, *args, **kwargs):
        if self.fn not in interpreted:
            interpreted[self.fn] = InterpretedFunction(self.fn)
        return interpreted[self.fn](*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original


class Kernel:
    """A Triton kernel launched as `kernel[grid](*args)`: compiled (`triton.jit`) for CUDA tensors,
    run by Triton's interpreter (numpy) for CPU tensors — how the kernels are tested without a GPU.
    The choice is per launch, so TRITON_INTERPRET need not be set (it is honoured if it is)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled = None
        self._interpreted = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if any(isinstance(a, Tensor) and a.device.type == "cpu" for a in args):
                from triton.runtime.interpreter import InterpretedFunction

                if self._interpreted is None:
                    self._interpreted = InterpretedFunction(self.fn)
                with _nested_jit_interpreted():
                    return self._interpreted[grid](*args, **kwargs)
            if self._compiled is None:
                self._compiled = triton.jit(self.fn)
            return self._compiled[grid](*args, **kwargs)

        return launch


def kernel(fn: Callable) -> Kernel:
    """Decorator for the kernels of this package (in place of `@triton.jit`; see `Kernel`)."""
    return Kernel(fn)


def check_float(name: str, tensor: Tensor) -> None:
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be float32, bfloat16 or float16; got {tensor.dtype}")


def check_device(*tensors: Tensor) -> None:
    """All on one device, CUDA or CPU (CPU runs the interpreter: correct, and slow)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type not in ("cuda", "cpu"):
        raise ValueError("the tensors must share one CUDA (or, interpreted, CPU) device; "
                         f"got {sorted(map(str, devices))}")


@triton.jit
def load_backward_rows(Q, OUT, GRAD_OUT, LSE, bh, rows, row_ok, offs_d, offs_e, d_ok, e_ok, length, dim,
                       value_dim):
    """A backward kernel's query-row block (rows of row-major [BH, length, ·] tensors), in float32:
    q, out, grad_out, the rows' log-sum-exp (-inf for an empty row read as 0: every weight of such
    a row is masked to 0), and the q and value-width masks the caller stores with."""
    qd_mask = row_ok[:, None] & d_ok[None, :]
    qe_mask = row_ok[:, None] & e_ok[None, :]
    q = tl.load(Q + bh * length * dim + rows[:, None] * dim + offs_d[None, :], mask=qd_mask,
                other=0.0).to(tl.float32)
    e_offsets = bh * length * value_dim + rows[:, None] * value_dim + offs_e[None, :]
    grad_out = tl.load(GRAD_OUT + e_offsets, mask=qe_mask, other=0.0).to(tl.float32)
    out = tl.load(OUT + e_offsets, mask=qe_mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + bh * length + rows, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    return q, out, grad_out, lse, qd_mask, qe_mask
