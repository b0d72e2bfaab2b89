"""Which backend runs each op: "triton" (ops/triton, GPU kernels), "native" (ops/native, C kernels
for the CPU) or "torch" (the PyTorch code in the op's own module, also every op's reference).

One function per op below holds the whole rule; the op calls it and runs what it says. The rules
share three questions:

- `triton_serves(*tensors)`: the tensors are on CUDA (or the backend "triton" is forced: CPU
  tensors then run through Triton's interpreter, exact and slow), not float64 (the kernels compute
  in fp32/bf16/fp16), `triton` is importable, `ROUTEFORMER_TRITON` is not "0", and no graph is
  being compiled (the Triton kernels are not registered as custom ops: a compiled graph keeps the
  PyTorch paths, so a CPU graph is unchanged).
- `native_kernels(*tensors)` (ops/native): CPU tensors of a dtype the kernels take, the library
  built on this machine, `ROUTEFORMER_NATIVE` not "0" and not inside `native_enabled(False)`
  (ops/backend_switches.py holds the switches).
- the op's own limits (the routing kernels' slot and dim limits, equal dtypes, whether a gradient
  is wanted where a kernel serves inference only).

Every decision is recorded: inside `recording()` (every attention layer's call opens one) each op
notes the backend it chose, and the layer returns them as `AttentionOutput.backends`
(op -> backend) with `AttentionOutput.backend` the summary ("native", "triton+torch", ...).

`force_backend(name)` forces one backend for a block (tests, benchmarks): "torch" runs every op in
PyTorch; "native" runs the C kernels wherever they take the inputs, whatever the native switches
say; "triton" sends every op that has a Triton kernel to it whatever the device (unless
`ROUTEFORMER_TRITON=0`; ops/backend_switches.py). An op the forced
backend cannot serve (no such kernel, inputs outside its limits) runs in PyTorch and says so.
Forcing a backend this machine lacks raises `BackendUnavailable`, naming what is missing.

`TOPK_DENSE_BELOW` is part of the dispatch too: the `topk` layer attends densely (a mask over one
SDPA call) below this many keys, a crossover measured per backend (docs/results/topk.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from routeformer.ops.backend_switches import (
    BACKENDS,
    forced_backend,
    reset_forced_backend,
    set_forced_backend,
    triton_switched_on,
)
from routeformer.ops.native import native_kernels, why_not_built
from routeformer.ops.native.linear import supported as linear_kernel_takes
from routeformer.ops.native.local import local_kernel_available
from routeformer.ops.triton import triton_available

TRITON, NATIVE, TORCH = BACKENDS

# Keys below which the `topk` layer attends densely instead of routing, by the backend its routed
# ops would take: the measured crossovers (docs/results/topk.md). The values are those the layer
# has always used; `topk_dense_below` picks one.
TOPK_DENSE_BELOW = {NATIVE: 256, TORCH: 1024}

Choice = tuple[str, str]  # (backend, why)


class BackendUnavailable(RuntimeError):
    """A forced backend this machine cannot run."""


# -- forcing -----------------------------------------------------------------------------------
def unavailable_reason(backend: str) -> str | None:
    """Why `backend` cannot run on this machine, or None when it can."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == TRITON and not triton_available():
        return "the triton package is not installed (pip install routeformer[gpu])"
    if backend == NATIVE and native_kernels_built() is False:
        return f"the native C kernels did not build: {why_not_built() or 'unknown reason'}"
    return None


def native_kernels_built() -> bool:
    """Whether the C library builds and loads here (builds it on first call; switches ignored)."""
    from routeformer.ops.native import load

    return load() is not None


@contextmanager
def force_backend(backend: str) -> Iterator[None]:
    """Within the block, every op takes `backend` where it can serve the inputs (see the module
    docstring). Raises ValueError for an unknown name, BackendUnavailable for a backend this
    machine lacks (the message says what is missing)."""
    missing = unavailable_reason(backend)
    if missing is not None:
        raise BackendUnavailable(f"force_backend({backend!r}): {missing}")
    token = set_forced_backend(backend)
    try:
        yield
    finally:
        reset_forced_backend(token)


@contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Within the block, ops whose Triton kernels exist run them whatever the device (tests, CPU);
    `enabled=False` restores the ordinary rule. Unlike `force_backend("triton")` it does not check
    that triton is installed: without it the ops keep their other paths."""
    token = set_forced_backend(TRITON if enabled else None)
    try:
        yield
    finally:
        reset_forced_backend(token)


# -- the shared questions ----------------------------------------------------------------------
def triton_serves(*tensors: Tensor) -> bool:
    """Whether an op with a Triton kernel should run it for these tensors (module docstring)."""
    if torch.compiler.is_compiling():
        return False
    if forced_backend() != TRITON and not (tensors and all(t.is_cuda for t in tensors)):
        return False
    if any(t.dtype == torch.float64 for t in tensors):
        return False
    return triton_switched_on() and triton_available()


def _native_serves(*tensors: Tensor) -> bool:
    return native_kernels(*tensors) is not None


# -- recording ---------------------------------------------------------------------------------
_RECORD: ContextVar[dict[str, str] | None] = ContextVar("routeformer_backend_record", default=None)


def joined(*backends: str) -> str:
    """Backends as one name: each once, in the order triton, native, torch ("native+torch")."""
    present = set("+".join(backends).split("+")) - {""}
    return "+".join(name for name in BACKENDS if name in present)


@contextmanager
def recording() -> Iterator[dict[str, str]]:
    """Collect, in the yielded dict, the backend of every op run within the block (op -> backend;
    an op run on two backends shows both). Nested blocks also report to the enclosing one."""
    parent = _RECORD.get()
    ran: dict[str, str] = {}
    token = _RECORD.set(ran)
    try:
        yield ran
    finally:
        _RECORD.reset(token)
        if parent is not None:
            for op, backend in ran.items():
                parent[op] = joined(parent.get(op, ""), backend)


def chosen(op: str, backend: str, why: str) -> Choice:
    """Record that `op` runs on `backend` (inside `recording()`, eagerly) and return (backend, why).
    Not recorded while a graph is compiled: the compiled code runs no Python per call."""
    if not torch.compiler.is_compiling():
        ran = _RECORD.get()
        if ran is not None:
            ran[op] = joined(ran.get(op, ""), backend)
    return backend, why


def _unrecorded(op: str, backend: str, why: str) -> Choice:
    return backend, why


# -- one rule per op ---------------------------------------------------------------------------
_CUDA = "Triton kernel (CUDA tensors, or forced)"
_CPU = "C kernel (CPU tensors of a dtype it takes)"
_NO_KERNEL = "no kernel serves these inputs (device, dtype, switches or limits)"


def route_topk_backend(route_q: Tensor, route_k: Tensor, slots: int) -> Choice:
    """ops.topk.routing.route_topk: Triton; else the C kernels within their slot and dim limits."""
    if triton_serves(route_q):
        return chosen("route_topk", TRITON, _CUDA)
    native = native_kernels(route_q, route_k)
    if native is not None and route_q.dtype == route_k.dtype and slots <= native.route_topk_max_slots() \
            and route_q.shape[-1] <= native.route_topk_max_dim():
        return chosen("route_topk", NATIVE, _CPU)
    return chosen("route_topk", TORCH, _NO_KERNEL)


# The decode shape (a non-causal `route_topk` call such as ops/topk/decode.py's over the cached keys)
# that takes the split-key Triton kernel: at most this many queries a row, at least this many keys,
# where one program per query block would scan every key alone. Set from the kernels' shapes, not
# measured: no GPU has timed the split kernel yet (docs/results/gpu.md has the one-program kernel's
# 71.5 ms at 64k).
DECODE_SPLIT_MAX_QUERIES = 16
DECODE_SPLIT_MIN_KEYS = 2048


def route_decode_backend(route_q: Tensor, num_keys: int) -> Choice | None:
    """A non-causal route_topk over `num_keys` keys where Triton serves it (route_topk_backend chose
    Triton): the split-key kernel (ops/triton/topk_decode_routing.py, recorded as op
    "route_topk_decode") for the decode shape; None otherwise (the one-program kernel)."""
    if route_q.shape[2] <= DECODE_SPLIT_MAX_QUERIES and num_keys >= DECODE_SPLIT_MIN_KEYS \
            and triton_serves(route_q):
        return chosen("route_topk_decode", TRITON, "split-key Triton kernel (decode shape: few queries, "
                                                   "many keys; CUDA tensors, or forced)")
    return None


def routed_attention_backend(q: Tensor, k: Tensor, v: Tensor, slots: int) -> Choice:
    """ops.topk.gathered.routed_attention: Triton; else the C kernel (equal dtypes, within its slots)."""
    if triton_serves(q):
        return chosen("routed_attention", TRITON, _CUDA)
    native = native_kernels(q, k, v) if q.dtype == k.dtype == v.dtype else None
    if native is not None and slots <= native.route_topk_max_slots():
        return chosen("routed_attention", NATIVE, _CPU)
    return chosen("routed_attention", TORCH, _NO_KERNEL)


def merge_partials_backend(out: Tensor) -> Choice:
    """ops.attention_lse.merge_partials: Triton, else PyTorch (no C kernel)."""
    if triton_serves(out):
        return chosen("merge_partials", TRITON, _CUDA)
    return chosen("merge_partials", TORCH, "no C kernel; not a Triton case")


def mita_parts_backend(op: str, q: Tensor) -> Choice:
    """ops.mita.experts.routed_parts / fused_single_route (`op`): Triton, else PyTorch."""
    if triton_serves(q):
        return chosen(op, TRITON, _CUDA)
    return chosen(op, TORCH, "not a Triton case (causal, unpadded, R = 1 CPU inputs take "
                             "mita_causal_backend's C kernel instead of these parts)")


def profile_range(name: str):
    """A torch.profiler range `routeformer::<name>` (what `routeformer bench layers --split` reads:
    routing, attention, ...); a no-op context while torch.compile traces (dynamo would drop it
    with a warning)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"routeformer::{name}")


def mita_causal_backend(q: Tensor, k: Tensor, v: Tensor, *, padded: bool, routes: int) -> Choice:
    """ops.mita.op's causal query side (own block + shared window + routed expert, forward and
    backward): the C kernels of native/mita_train_kernels.c for unpadded CPU float32/float64
    inputs of one dtype with one routed expert per query, else the PyTorch parts."""
    op = "mita_causal_query_side"
    if triton_serves(q):  # CUDA (or forced Triton): the parts run on their Triton kernels
        return chosen(op, TORCH, "the PyTorch parts, on their Triton kernels")
    if padded or routes != 1:
        return chosen(op, TORCH, "padded input or route > 1: no C kernel")
    same_dtype = q.dtype == k.dtype == v.dtype
    if q.dtype in (torch.float32, torch.float64) and same_dtype and _native_serves(q, k, v):
        return chosen(op, NATIVE, _CPU)
    return chosen(op, TORCH, _NO_KERNEL)


def mita_inference_backend(op: str, *tensors: Tensor) -> Choice:
    """ops.native.mita (MiTA's routed step, streaming top-K, argmax at inference, `op`): the C
    kernels for CPU float32/float64 tensors of one dtype, eagerly (not inside a compiled graph)."""
    first = tensors[0]
    if first.dtype in (torch.float32, torch.float64) and all(t.dtype == first.dtype for t in tensors) \
            and not torch.compiler.is_compiling() and _native_serves(*tensors):
        return chosen(op, NATIVE, _CPU)
    return chosen(op, TORCH, _NO_KERNEL)


def band_rows_backend(op: str, q_rows: Tensor, k: Tensor, v: Tensor, causal: bool,
                      mask: Tensor | None) -> Choice:
    """ops.routed_rows full/local rows (`op`): causal and unpadded rows take the Triton banded
    pass, or (inference only, equal dtypes) the C banded pass; the rest PyTorch."""
    if causal and mask is None and triton_serves(q_rows):
        return chosen(op, TRITON, _CUDA)
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_rows, k, v))
    if causal and mask is None and not wants_grad and q_rows.dtype == k.dtype == v.dtype \
            and _native_serves(q_rows, k, v):
        return chosen(op, NATIVE, "C banded pass (causal, unpadded, inference)")
    return chosen(op, TORCH, _NO_KERNEL)


def linear_rows_backend(q_rows: Tensor, k: Tensor, v: Tensor) -> Choice:
    """ops.routed_rows.linear_attention_rows (causal): the C kernels for equal dtypes they take
    (with the features applied in C at inference), else PyTorch."""
    if q_rows.dtype == k.dtype == v.dtype and _native_serves(q_rows, k, v):
        return chosen("linear_attention_rows", NATIVE, _CPU)
    return chosen("linear_attention_rows", TORCH, _NO_KERNEL)


def expanding_backend(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool,
                      update: str) -> Choice:
    """ops.expanding.op.expanding_attention: the C kernels for causal, unpadded inputs under the
    paper's update (the only one they implement), equal dtypes they take; else the PyTorch steps
    (whose final pass is `expanding_final_pass_backend`)."""
    if causal and mask is None and update == "paper" and q.dtype == k.dtype == v.dtype \
            and _native_serves(q, k, v):
        return chosen("expanding_attention", NATIVE, _CPU)
    return chosen("expanding_attention", TORCH, _NO_KERNEL)


def expanding_final_pass_backend(q: Tensor, causal: bool, masked: bool) -> Choice:
    """The PyTorch expanding path's final banded pass: Triton for causal, unpadded inputs."""
    if causal and not masked and triton_serves(q):
        return chosen("expanding_final_pass", TRITON, _CUDA)
    return chosen("expanding_final_pass", TORCH, "no Triton case (the C path runs its own)")


def linear_backend(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Choice:
    """ops.linear.op.linear_attention: the C kernels for causal inputs they take, else PyTorch."""
    if causal and linear_kernel_takes(q, k, v) and _native_serves(q, k, v):
        return chosen("linear_attention", NATIVE, _CPU)
    return chosen("linear_attention", TORCH, _NO_KERNEL)


def local_backend(q: Tensor, k: Tensor, v: Tensor, *, record: bool = True) -> Choice:
    """ops.local.op.local_attention: the C kernel for non-empty fp32/bf16/fp16 inputs of one dtype
    where it was built (at every instruction-set level), else the blockwise PyTorch path. `record=False` for a
    probe (the FLOP count asks which path would run without running it)."""
    choose = chosen if record else _unrecorded
    if q.numel() and q.dtype == k.dtype == v.dtype and q.dtype != torch.float64 \
            and _native_serves(q, k, v) and local_kernel_available():
        return choose("local_attention", NATIVE, _CPU)
    return choose("local_attention", TORCH, _NO_KERNEL)


def rotary_backend(x: Tensor, cos: Tensor, sin: Tensor, takes_layout: bool) -> Choice:
    """ops.rotary.apply_rotary: the C kernel when the angles have the layout it takes
    (`takes_layout`, checked by the op) and the tensors are ones it takes, else PyTorch."""
    if takes_layout and _native_serves(x, cos, sin):
        return chosen("rotary", NATIVE, _CPU)
    return chosen("rotary", TORCH, _NO_KERNEL)


def routing_cache_backend(route_k: Tensor) -> Choice:
    """ops.topk.decode: whether cached routing keys take the C kernel's tiled layout."""
    native = native_kernels(route_k)
    if native is not None and route_k.dtype in (torch.float32, torch.float64) \
            and route_k.shape[-1] <= native.route_topk_max_dim():
        return NATIVE, _CPU
    return TORCH, _NO_KERNEL


def topk_dense_below(q: Tensor, k: Tensor, v: Tensor) -> int:
    """The `topk` layer's default dense threshold for these tensors (`TOPK_DENSE_BELOW`): the
    native crossover where the C kernels serve them, else the PyTorch one."""
    return TOPK_DENSE_BELOW[NATIVE if _native_serves(q, k, v) else TORCH]


def switch_values() -> dict[str, str]:
    """The environment switches as this process sees them, for `routeformer doctor`."""
    import os

    names = ("ROUTEFORMER_NATIVE", "ROUTEFORMER_TRITON")
    return {name: os.environ.get(name, "(unset: on)") for name in names}
