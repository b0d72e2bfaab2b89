"""Optional fused CPU kernels (C, compiled once per machine, called through ctypes).

The kernel files (every `*_kernels.c` here goes into one library) and their wrappers:
- `topk`: `topk_kernels.c` (routing selection, the reference kernel and fp64; the gathered
  attention forward/backward), `topk_speculative_kernels.c` (the routing selection that runs for
  fp32/bf16: a bf16 prefilter, exact fp32 rescoring, verified threshold guesses),
  `topk_bf16_attention_kernels.c` (the gathered attention reading bf16 as stored); wrapper topk.py.
- `local`: `local_kernels.c` (forward), `local_backward_kernels.c`, `local_rows_kernels.c`
  (softmax rows, conversions), `local_tiles_kernels.c` (register tiles, bf16 pair products);
  wrapper local.py.
- causal `linear`: `linear_kernels.c` (forward/backward sweeps), `linear_gemm_kernels.c`,
  `linear_chunk_kernels.c`, `linear_bf16_kernels.c`; wrapper linear.py.
- hard-routed `meta`: `band_kernels.c` (query-blocked banded softmax pass: the local expert at its
  rows, and expanding's final pass), `linear_rows_kernels.c` (the linear expert at its rows);
  wrappers band.py, linear_rows.py.
- `expanding_kernels.c` (expanding attention's inference steps and final-pass backward),
  `mita_kernels.c` (MiTA's routed step and streaming top-K at inference; ops/mita_native.py),
  `rotary_kernels.c` (rotary embedding; rotary.py).
On first use they are compiled with the system C compiler (`$CC`, else `cc`) with -O3,
-march=native and OpenMP into one library in a cache directory (`$ROUTEFORMER_CACHE_DIR`, else
~/.cache/routeformer, else the temporary directory), keyed by the sources, headers, flags, the
CPU and what the compiler resolves -march=native to (so a cache directory shared by machines of
one type never hands one CPU another's build); later processes load the cached library (seconds
to compile, no PyTorch headers involved).

Platforms (`build_plan`): Linux (gcc or clang; tested: x86-64, gcc) builds with -march=native
and -fopenmp. macOS: -march=native (-mcpu=native where the compiler refuses that), OpenMP through
libomp where it is installed (Apple clang: -Xpreprocessor -fopenmp against Homebrew's or
MacPorts' libomp, or `$ROUTEFORMER_LIBOMP`), else no OpenMP. A compiler that refuses the OpenMP
flags gets one more try without them: the library then runs on one thread, and the build says so
in one warning. Windows: no build; the ops run in PyTorch (one warning). (macOS and Windows are
simulated in tests/ops/test_native_platforms.py, not run.)

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
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

# Every *_kernels.c beside this file goes into the one library (a new kernel file needs no edit here;
# its Python wrapper declares its functions with `kernel`).
SOURCES = tuple(sorted(Path(__file__).parent.glob("*_kernels.c")))
HEADER = Path(__file__).with_name("common.h")
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # every header: an edit rebuilds the library
_ENABLED: ContextVar[bool] = ContextVar("routeformer_native_enabled", default=True)
BASE_FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-std=c11",
              "-Werror=implicit-function-declaration")  # a missing helper fails the build, not the load
OPENMP_FLAGS = ("-fopenmp",)
# The Linux build's flags (tests compile probes with them).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11",
         "-Werror=implicit-function-declaration")
_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
_PROBE_TIMEOUT_S = 60  # a compiler driver asked what -march=native means (it answers in ~30 ms)
_BUILD_TIMEOUT_S = 600  # the whole library (~20-60 s on a loaded 2-core machine)
# Where libomp lives when installed by Homebrew (Apple silicon, Intel) or MacPorts: (include, lib).
_LIBOMP_PLACES = (("/opt/homebrew/opt/libomp/include", "/opt/homebrew/opt/libomp/lib"),
                  ("/usr/local/opt/libomp/include", "/usr/local/opt/libomp/lib"),
                  ("/opt/local/include/libomp", "/opt/local/lib/libomp"))


def _cpu_signature() -> str:
    """The CPU model and flags where the system says them (Linux's /proc/cpuinfo), else the machine
    type; `_native_target` adds what the compiler resolves -march=native to."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(line for line in lines if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _resolved_flags(driver_output: str) -> str:
    """The target options in a compiler driver's `-###` listing: gcc expands -march=native into
    -march=<cpu> and -m<feature> / -mno-<feature> options; clang into -target-cpu <cpu> and
    -target-feature +/-<feature>. Paths, temporary names and the working directory are left out
    (they vary between calls and would change the cache key)."""
    tokens = [token.strip("'\"") for token in driver_output.split()]
    kept = []
    for index, token in enumerate(tokens):
        if token in ("-target-cpu", "-target-feature", "--param") and index + 1 < len(tokens):
            kept.append(f"{token} {tokens[index + 1]}")  # gcc: --param l1-cache-size=32
        elif token.startswith(("-m", "--param")):
            kept.append(token)
    return " ".join(kept)


def _native_target(compiler: str) -> tuple[tuple[str, ...], str]:
    """(the flag that compiles for this CPU, what it resolves to): -march=native where the compiler
    takes it, else -mcpu=native (some arm64 compilers), else no flag (a generic build, keyed by the
    machine type). Asked of the driver with `-###`, which compiles nothing."""
    for flag in ("-march=native", "-mcpu=native"):
        probe = subprocess.run([compiler, flag, "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull],
                               capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
        if probe.returncode == 0:
            return (flag,), _resolved_flags(probe.stdout + probe.stderr)
    return (), platform.machine()


def _libomp() -> tuple[str, str] | None:
    """(include, lib) directories of an installed libomp (macOS), or None."""
    configured = os.environ.get("ROUTEFORMER_LIBOMP")  # a prefix holding include/ and lib/
    places = ((f"{configured}/include", f"{configured}/lib"),) if configured else _LIBOMP_PLACES
    for include, lib in places:
        if Path(include, "omp.h").exists() and Path(lib).is_dir():
            return include, lib
    return None


def _is_apple_clang(compiler: str) -> bool:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return False
    return "Apple" in version.stdout + version.stderr


@dataclass(frozen=True)
class BuildPlan:
    """How the library is compiled and linked on this platform: `flags` go to every build,
    `openmp` / `openmp_link` only to the first try (a compiler that refuses them gets a second try
    without OpenMP); `target` is what the CPU flag resolves to (part of the cache key)."""
    flags: tuple[str, ...]
    openmp: tuple[str, ...]
    openmp_link: tuple[str, ...]
    target: str
    no_openmp: str | None = None  # why the plan has no OpenMP (told in one warning at build time)

    def key_text(self, compiler: str) -> str:
        return " ".join((compiler, sys.platform, *self.flags, "|", *self.openmp, "|", *self.openmp_link,
                         "|", self.target))


def build_plan(compiler: str) -> BuildPlan:
    """The flags for this platform (see the module docstring): Linux and other Unix-likes
    -fopenmp; macOS a libomp where one is installed (Apple clang needs -Xpreprocessor), else
    -fopenmp for a compiler that is not Apple's, else no OpenMP."""
    arch, target = _native_target(compiler)
    shared = ("-dynamiclib",) if sys.platform == "darwin" else ("-shared",)
    flags = (*BASE_FLAGS, *arch, *shared)
    if sys.platform != "darwin":
        return BuildPlan(flags, OPENMP_FLAGS, OPENMP_FLAGS, target)
    apple = _is_apple_clang(compiler)
    libomp = _libomp()
    if libomp is not None:
        include, lib = libomp
        openmp = ("-Xpreprocessor", "-fopenmp", f"-I{include}") if apple else (*OPENMP_FLAGS, f"-I{include}")
        return BuildPlan(flags, openmp, (f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"), target)
    if apple:
        return BuildPlan(flags, (), (), target, "Apple clang needs libomp, and none was found in "
                         f"{', '.join(lib for _, lib in _LIBOMP_PLACES)} or $ROUTEFORMER_LIBOMP")
    return BuildPlan(flags, OPENMP_FLAGS, OPENMP_FLAGS, target)


def _user_tag() -> str:
    """A per-user name for the temporary cache directory (os.getuid exists on POSIX only)."""
    getuid = getattr(os, "getuid", None)
    if getuid is not None:
        return str(getuid())
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name to be had: one shared directory
        return "user"


def _cache_dir() -> Path:
    configured = os.environ.get("ROUTEFORMER_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "routeformer"


def _compile(compiler: str, plan: BuildPlan, target: Path) -> str | None:
    """Build the library at `target`; returns None, or why it was built without OpenMP (the plan
    has none, or the compiler refused the OpenMP flags and the build without them succeeded). Raises
    CalledProcessError / TimeoutExpired / OSError when no build succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name

        def run(openmp: tuple[str, ...], openmp_link: tuple[str, ...]) -> None:
            subprocess.run([compiler, *plan.flags, *openmp, *map(str, SOURCES), "-o", str(built),
                            *openmp_link, "-lm"], check=True, capture_output=True, text=True,
                           timeout=_BUILD_TIMEOUT_S)

        without_openmp = plan.no_openmp
        try:
            run(plan.openmp, plan.openmp_link)
        except subprocess.CalledProcessError as refused:
            said = (refused.stderr or "").lower()
            if not plan.openmp or not ("openmp" in said or "omp" in said):  # -fopenmp, -lomp, omp.h
                raise  # not OpenMP's failure: a second build would fail the same way
            run((), ())  # raises in turn when the failure was not OpenMP's
            reason = (refused.stderr or "").strip().splitlines()
            without_openmp = "the compiler refused it: " + (reason[-1] if reason else
                                                            f"exit status {refused.returncode}")
        os.replace(built, target)
    return without_openmp


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """The library as loaded: its functions are declared where they are used (`declare`, in each
    wrapper module) and set up, checked against their C prototypes, by `kernel`."""
    return library


def _fallback_warning(reason: str, detail: str = "") -> None:
    warnings.warn(f"routeformer: {reason}; the topk, expanding and meta row ops run in PyTorch (slower). "
                  f"Set ROUTEFORMER_NATIVE=0 to silence this.{' ' + detail if detail else ''}", stacklevel=4)


@cache
def _load() -> ctypes.CDLL | None:
    if sys.platform in ("win32", "cygwin"):
        _fallback_warning("the native kernels are built on Linux and macOS only, not on Windows")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _fallback_warning("no C compiler found (install cc/gcc to build the native kernels)")
        return None
    try:
        plan = build_plan(compiler)
    except (OSError, subprocess.SubprocessError) as failed:  # the compiler cannot be run at all
        _fallback_warning(f"the C compiler {compiler!r} could not be run ({failed})")
        return None
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + plan.key_text(compiler).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    error: Exception | None = None
    # A read-only home (some CI runners) falls back to the temporary directory.
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"routeformer-{_user_tag()}"):
        target = directory / f"routeformer_native_{key}.so"
        try:
            if not target.exists():
                without_openmp = _compile(compiler, plan, target)
                if without_openmp is not None:
                    warnings.warn(f"routeformer: the native kernels were built without OpenMP "
                                  f"({without_openmp[-300:]}); they run on one thread. Install libomp "
                                  f"(macOS: brew install libomp) and delete {target} to rebuild with "
                                  "threads.", stacklevel=3)
            return _declare(ctypes.CDLL(str(target)))
        except subprocess.SubprocessError as failed:  # the compiler itself failed: no retry
            error = failed
            break
        except OSError as failed:
            error = failed
    detail = getattr(error, "stderr", "") or str(error)
    _fallback_warning("compiling the native kernels failed", detail[-2000:])
    return None


@contextmanager
def native_enabled(enabled: bool) -> Iterator[None]:
    """Within the block, the ops use the native kernels (when they can) or never use them; e.g. to
    time the PyTorch path beside the native one."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


class NativeKernels:
    """What the ops need to know of the loaded library: its size limits, as plain ints (read once,
    so torch.compile traces them as constants). The kernels themselves are reached through the
    custom ops of ops/native/custom_ops.py."""

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
    library = _load()  # cached; a test may clear that cache, so the handle follows the library
    if library is None:
        return None
    if id(library) not in _HANDLES:
        _HANDLES[id(library)] = NativeKernels(library)
    return _HANDLES[id(library)]


def _switched_on() -> bool:
    return _ENABLED.get() and os.environ.get("ROUTEFORMER_NATIVE", "1") != "0"


@torch.compiler.assume_constant_result
def _usable_when_compiling() -> bool:
    """Whether the kernels serve a graph being traced: run once at trace time, its answer baked in
    (dynamo traces neither ContextVars nor ctypes)."""
    global _HANDLE_WHEN_COMPILING
    _HANDLE_WHEN_COMPILING = _handle() if _switched_on() else None
    return _HANDLE_WHEN_COMPILING is not None


def native_kernels(*tensors: Tensor) -> NativeKernels | None:
    """The loaded kernels if they can serve these tensors, else None (use the PyTorch path)."""
    if any(t.device.type != "cpu" or t.dtype not in KERNEL_DTYPES for t in tensors):
        return None
    if torch.compiler.is_compiling():
        # The custom ops keep the kernels in the graph; the switches are read at trace time.
        return _HANDLE_WHEN_COMPILING if _usable_when_compiling() else None
    return _handle() if _switched_on() else None


_HANDLE_WHEN_COMPILING: NativeKernels | None = None  # set by _usable_when_compiling


class NativeOp:
    """A kernel wrapper registered as the custom op `routeformer::<name>` (`.op`, for
    register_fake / register_autograd / opcheck). A call goes through the op — which torch.compile
    keeps in its graph and autograd differentiates — while a graph is traced or a gradient is
    wanted; otherwise (inference, decoding) it calls the function directly: the dispatcher's
    round trip costs ~0.1-0.2 ms per call (measured on the loaded 2-core machine, 2026-11-25),
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
    loaded = _load()
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
