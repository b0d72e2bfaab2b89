"""Helpers shared by the Triton kernel files: the launcher that picks compiled or interpreted
kernels by device, argument checks and block sizes.

`triton` is imported here, so only the kernel files import this module (lazily, from `dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import triton
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
