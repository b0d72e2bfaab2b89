"""Optional fused CPU kernels (C, compiled once per machine, called through ctypes).

The kernel files (every `*_kernels.c` here goes into one library) and their Python wrappers are listed
in docs/kernels.md ("Native kernel files").
On first use (build.py) they are compiled with the system C compiler (`$CC`, else `cc`) with -O3,
-march=native and OpenMP into one library in a cache directory (`$ROUTEFORMER_CACHE_DIR`, else
~/.cache/routeformer, else the temporary directory), keyed by the sources, headers, flags, the
CPU and what the compiler resolves -march=native to (so a cache directory shared by machines of
one type never hands one CPU another's build); later processes load the cached library (seconds
to compile, no PyTorch headers involved).

Instruction-set levels (`ROUTEFORMER_ISA`, build.py's `isa_level`): `native` (default,
-march=native), `avx512` (-march=x86-64-v4), `avx2` (-march=x86-64-v3: AVX2 + FMA) or `generic`
(-march=x86-64, no -march off x86). Each kernel file selects its code with `#if
defined(__AVX512F__)` / `#elif defined(__AVX2__) && defined(__FMA__)` / `#else` (plain C), so
every level builds every kernel; the level is in the cache key, a level above the CPU raises
ValueError, and `compiled_isa()` (isa_kernels.c) says what was compiled (`routeformer doctor`).

Platforms (`build_plan`; Linux with gcc tested, macOS and Windows simulated): docs/kernels.md
("Platforms").

Every kernel is wrapped as a `torch.library` custom op (`routeformer::*`; see `NativeOp`) with a
fake (shape) implementation and registered autograd, so `torch.compile` keeps the kernels in its
graphs. bfloat16: the topk, local and causal linear kernels read and write it as stored and
accumulate in float32 (AVX-512 BF16 pair products where they pay; common.h's conversions round as
torch does); the other kernels compute in float32 or float64 and take bfloat16/float16 through
float32 copies at the op boundary (O(T·d)).

Every kernel has a PyTorch twin in `routeformer.ops` that is the reference in the tests and the
fallback: `native_kernels()` returns None — and the ops run in PyTorch — when
`ROUTEFORMER_NATIVE=0` or inside `native_enabled(False)` (both read when a graph is traced, under
`torch.compile`), on a machine with no C compiler (one warning), or for tensors the kernels do
not take (not CPU, or not float32/float64/bfloat16/float16).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from routeformer.ops._compile_marks import assume_constant_result
from routeformer.ops.backend_switches import native_enabled, native_switched_on
from routeformer.ops.native.build import (
    FLAGS,
    HEADER,
    HEADERS,
    ISA_LEVELS,
    SOURCES,
    isa_level,
    load,
    requested_isa,
    why_not_built,
)

__all__ = ["FLAGS", "HEADER", "HEADERS", "ISA_LEVELS", "SOURCES", "KERNEL_DTYPES", "compiled_isa",
           "isa_level", "requested_isa", "NativeKernels", "NativeOp",
           "compute_dtype", "declare", "kernel", "library", "load", "native_enabled", "native_kernels",
           "native_op", "pointer", "suffix", "why_not_built", "widened"]

_INT = ctypes.c_int64


class NativeKernels:
    """What the ops need to know of the loaded library: its size limits, as plain ints (read once,
    so torch.compile traces them as constants). The kernels themselves are reached through the
    custom ops `NativeOp` registers (below)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self.max_slots = int(kernel("route_topk_max_slots", library)())
        self.max_dim = int(kernel("route_topk_max_dim", library)())
        self.chunk = int(kernel("route_topk_chunk", library)())
        self.query_tile = int(kernel("route_topk_query_tile", library)())

    def route_topk_max_slots(self) -> int:
        return self.max_slots

    def route_topk_max_dim(self) -> int:
        return self.max_dim

    def route_topk_chunk(self) -> int:
        return self.chunk

    def route_topk_query_tile(self) -> int:
        return self.query_tile


KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


_HANDLES: dict[int, NativeKernels] = {}


def _handle() -> NativeKernels | None:
    library = load()  # cached; a test may clear that cache, so the handle follows the library
    if library is None:
        return None
    if id(library) not in _HANDLES:
        _HANDLES[id(library)] = NativeKernels(library)
    return _HANDLES[id(library)]


@assume_constant_result
def _usable_when_compiling() -> bool:
    """Whether the kernels serve a graph being traced: run once at trace time, its answer baked in
    (dynamo traces neither ContextVars nor ctypes)."""
    global _HANDLE_WHEN_COMPILING
    _HANDLE_WHEN_COMPILING = _handle() if native_switched_on() else None
    return _HANDLE_WHEN_COMPILING is not None


def native_kernels(*tensors: Tensor) -> NativeKernels | None:
    """The loaded kernels if they can serve these tensors, else None (use the PyTorch path)."""
    if any(t.device.type != "cpu" or t.dtype not in KERNEL_DTYPES for t in tensors):
        return None
    if torch.compiler.is_compiling():
        # The custom ops keep the kernels in the graph; the switches are read at trace time.
        return _HANDLE_WHEN_COMPILING if _usable_when_compiling() else None
    return _handle() if native_switched_on() else None


_HANDLE_WHEN_COMPILING: NativeKernels | None = None  # set by _usable_when_compiling


class NativeOp:
    """A kernel wrapper registered as the custom op `routeformer::<name>` (`.op`, for
    register_fake / register_autograd / opcheck). A call goes through the op — which torch.compile
    keeps in its graph and autograd differentiates — while a graph is traced or a gradient is
    wanted; otherwise (inference, decoding) it calls the function directly: the dispatcher's
    round trip costs ~0.1-0.2 ms per call (measured on a loaded 2-core machine),
    which decoding would pay per token and layer."""

    def __init__(self, name: str, function) -> None:
        self.op = torch.library.custom_op(f"routeformer::{name}", mutates_args=())(function)
        self.function = function
        self.__doc__ = function.__doc__

    def __call__(self, *args):
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
                isinstance(arg, Tensor) and arg.requires_grad for arg in args)):
            return self.op(*args)
        return self.function(*args)


def native_op(name: str):
    """Decorator: the function as a `NativeOp` named `routeformer::<name>`."""
    return lambda function: NativeOp(name, function)


def library() -> ctypes.CDLL:
    """The loaded library, for the custom ops' implementations (called only after
    `native_kernels` said yes)."""
    loaded = load()
    if loaded is None:
        raise RuntimeError("routeformer: the native kernels are not available on this machine")
    return loaded


# -- the C boundary: every kernel declared once, checked against its C prototype ------------------
# name -> (restype, argtypes): filled by `declare` when the wrapper modules are imported.
DECLARED: dict[str, tuple[object, tuple]] = {}
_KERNELS: dict[str, tuple[ctypes.CDLL, ctypes._CFuncPtr]] = {}  # name -> (library, declared function)


def declare(restype, argtypes: list, *names: str) -> None:
    """Declare the C functions `names` (twins such as `band_attend_f32` and `band_attend_f64` share
    one signature): ctypes return type (None: void) and argument types, written once, beside the
    wrapper that calls them. `kernel` checks the declaration against the C prototype the first time
    it hands the function out (routeformer.ops.native.boundary). Declaring a name again with the
    same signature is a no-op; with another, an error."""
    signature = (restype, tuple(argtypes))
    for name in names:
        if DECLARED.setdefault(name, signature) != signature:
            raise ValueError(f"routeformer: `{name}` is declared twice with different ctypes signatures: "
                             f"{DECLARED[name]} and {signature}")


def kernel(name: str, loaded: ctypes.CDLL | None = None) -> ctypes._CFuncPtr:
    """The C function `name` of the loaded library (or of `loaded`), with the ctypes signature
    `declare` gave it. The first time, the declaration is compared with the function's C prototype
    in the kernel sources (number of arguments, the kind of each: pointer / int64 / int32 / double /
    float, and the return type) and a mismatch raises `boundary.CBoundaryError`, naming the
    function and the argument: ctypes itself would call it anyway and read garbage."""
    library_ = library() if loaded is None else loaded
    found = _KERNELS.get(name)
    if found is not None and found[0] is library_:
        return found[1]
    if name not in DECLARED:
        raise KeyError(f"routeformer: the C function `{name}` has no declaration; declare(restype, "
                       "argtypes, name) it beside its wrapper")
    restype, argtypes = DECLARED[name]
    from routeformer.ops.native import boundary  # the C sources are read once, on first use

    boundary.check(name, restype, argtypes)
    function = getattr(library_, name)
    function.restype, function.argtypes = restype, list(argtypes)
    _KERNELS[name] = (library_, function)
    return function


# Declared here: the size limits NativeKernels reads (the kernels are declared beside their wrappers).
declare(_INT, [], "route_topk_max_slots", "route_topk_max_dim", "route_topk_chunk", "route_topk_query_tile")
declare(_INT, [], "rf_isa_level", "rf_isa_has_bf16")  # isa_kernels.c

_COMPILED_LEVELS = {3: "avx512", 2: "avx2", 1: "generic"}


def compiled_isa(loaded: ctypes.CDLL | None = None) -> tuple[str, bool] | None:
    """(the instruction-set level the loaded library's kernels were compiled for — "avx512",
    "avx2" or "generic" — and whether the AVX-512 BF16 pair products are in it), as the C
    preprocessor saw it (isa_kernels.c); None where no library is loaded."""
    library_ = load() if loaded is None else loaded
    if library_ is None:
        return None
    level = _COMPILED_LEVELS[int(kernel("rf_isa_level", library_)())]
    return level, bool(kernel("rf_isa_has_bf16", library_)())


def widened(tensor: Tensor) -> Tensor:
    """float32 for bfloat16/float16 (the kernels compute in fp32), else the tensor itself."""
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes in for inputs of `dtype`."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def pointer(tensor: Tensor | None) -> int | None:
    """The data address of a contiguous tensor, for a ctypes call (None for NULL)."""
    if tensor is None:
        return None
    assert tensor.is_contiguous(), "native kernels take contiguous tensors"
    return tensor.data_ptr()


def suffix(dtype: torch.dtype) -> str:
    """The kernel name's suffix for a compute dtype (float32 or float64)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the native kernels compute in float32 or float64; got {dtype}")
    return "f32" if dtype == torch.float32 else "f64"
