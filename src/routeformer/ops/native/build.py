"""Building the native kernels: the platform's flags (`build_plan`), the compile into a cache
directory keyed by sources, flags and CPU, and the load (`load`). ops/native/__init__.py says
where the library is used and how the build behaves on each platform."""

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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# Every *_kernels.c beside this file goes into the one library (a new kernel file needs no edit here;
# its Python wrapper declares its functions with `kernel`).
SOURCES = tuple(sorted(Path(__file__).parent.glob("*_kernels.c")))
HEADER = Path(__file__).with_name("common.h")
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # every header: an edit rebuilds the library
BASE_FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-std=c11",
              "-Werror=implicit-function-declaration")  # a missing helper fails the build, not the load
OPENMP_FLAGS = ("-fopenmp",)
# The Linux build's flags (tests compile probes with them).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11",
         "-Werror=implicit-function-declaration")
# The instruction-set levels `ROUTEFORMER_ISA` chooses between (see `isa_level`): `native` (the
# default) compiles for this CPU (-march=native: every feature it has, AVX-512 BF16 included);
# the others for a fixed x86-64 level, so one machine builds and tests every lower level. The
# kernels select their code with the preprocessor (`#if defined(__AVX512F__)` ... `#elif
# defined(__AVX2__) && defined(__FMA__)` ... `#else` plain C), so every level builds every kernel.
ISA_LEVELS = ("native", "avx512", "avx2", "generic")
# The x86 target of each forced level: x86-64-v4 (AVX-512 F/BW/DQ/VL/CD, no BF16), x86-64-v3
# (AVX2, FMA, BMI, F16C), x86-64 (SSE2). `generic` off x86 passes no -march (the compiler's default
# target: the portable C paths, which the compiler vectorises with what that target has).
_X86_LEVEL_FLAGS = {"avx512": ("-march=x86-64-v4",), "avx2": ("-march=x86-64-v3",),
                    "generic": ("-march=x86-64",)}
# What the CPU must have for a forced level's code not to die of SIGILL: the compiler's macros for
# -march=native must include these (the features x86-64-v3 / -v4 add, less XSAVE).
_AVX2_MACROS = ("__AVX__", "__AVX2__", "__FMA__", "__BMI__", "__BMI2__", "__F16C__", "__LZCNT__",
                "__MOVBE__")
_LEVEL_MACROS = {"avx2": _AVX2_MACROS,
                 "avx512": (*_AVX2_MACROS, "__AVX512F__", "__AVX512BW__", "__AVX512DQ__",
                            "__AVX512VL__", "__AVX512CD__"),
                 "generic": ()}
_X86_MACHINES = ("x86_64", "amd64", "x86-64", "i386", "i686")
_PROBE_TIMEOUT_S = 60  # a compiler driver asked what -march=native means (it answers in ~30 ms)
_BUILD_TIMEOUT_S = 600  # the whole library (~20-60 s on a loaded 2-core machine)
# Where libomp lives when installed by Homebrew (Apple silicon, Intel) or MacPorts: (include, lib).
_LIBOMP_PLACES = (("/opt/homebrew/opt/libomp/include", "/opt/homebrew/opt/libomp/lib"),
                  ("/usr/local/opt/libomp/include", "/usr/local/opt/libomp/lib"),
                  ("/opt/local/include/libomp", "/opt/local/lib/libomp"))


def compiler() -> str | None:
    """The C compiler the build uses: `$CC`, else `cc`, else `gcc` (None: none found)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


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


def isa_level() -> str:
    """The instruction-set level `$ROUTEFORMER_ISA` asks for (one of ISA_LEVELS; unset or empty:
    "native"). Raises ValueError, naming the allowed values, for any other value."""
    level = os.environ.get("ROUTEFORMER_ISA", "").strip().lower() or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"ROUTEFORMER_ISA={os.environ.get('ROUTEFORMER_ISA')!r} is not an instruction-set "
                         f"level; allowed: {', '.join(ISA_LEVELS)} (unset: native, what this CPU has)")
    return level


def _is_x86() -> bool:
    return platform.machine().lower() in _X86_MACHINES


def _macros(compiler: str, flags: tuple[str, ...]) -> set[str] | None:
    """The macros the compiler predefines with `flags` (`-dM -E`), or None if it refuses them."""
    probe = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                           text=True, timeout=_PROBE_TIMEOUT_S)
    if probe.returncode != 0:
        return None
    return {line.split()[1] for line in probe.stdout.splitlines() if line.startswith("#define ")}


def native_isa(compiler: str) -> str:
    """The level -march=native builds on this CPU: "avx512", "avx2" or "generic" (what the
    compiler predefines for it: __AVX512F__, else __AVX2__ with __FMA__, else neither)."""
    macros = _macros(compiler, ("-march=native",)) or set()
    if "__AVX512F__" in macros:
        return "avx512"
    return "avx2" if {"__AVX2__", "__FMA__"} <= macros else "generic"


def level_flags(compiler: str, level: str) -> tuple[str, ...]:
    """The target flags of a forced level (not "native"), after checking that this CPU can run
    what they compile: ValueError for an x86 level on a CPU that is not x86, or one above the
    CPU's features (its code would die of SIGILL), naming what is missing."""
    if level == "generic":
        return _X86_LEVEL_FLAGS["generic"] if _is_x86() else ()
    if not _is_x86():
        raise ValueError(f"ROUTEFORMER_ISA={level} is an x86-64 level and this CPU is {platform.machine()}; "
                         "allowed here: native, generic")
    native = _macros(compiler, ("-march=native",))
    if native is None:
        raise ValueError(f"ROUTEFORMER_ISA={level}: the compiler {compiler!r} cannot say what this CPU has "
                         "(it refuses -march=native), so the level cannot be checked; use native or generic")
    missing = [macro.strip("_") for macro in _LEVEL_MACROS[level] if macro not in native]
    if missing:
        raise ValueError(f"ROUTEFORMER_ISA={level} needs {', '.join(missing)}, which this CPU lacks (its "
                         f"code would stop with SIGILL); this CPU builds at most {native_isa(compiler)}: use "
                         "that, a lower level, or native")
    return _X86_LEVEL_FLAGS[level]


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
    isa: str = "native"  # the ROUTEFORMER_ISA level (ISA_LEVELS) the flags compile for

    def key_text(self, compiler: str) -> str:
        return " ".join((compiler, sys.platform, f"isa={self.isa}", *self.flags, "|", *self.openmp, "|",
                         *self.openmp_link, "|", self.target))


def build_plan(compiler: str, isa: str | None = None) -> BuildPlan:
    """The flags for this platform (see the module docstring): Linux and other Unix-likes
    -fopenmp; macOS a libomp where one is installed (Apple clang needs -Xpreprocessor), else
    -fopenmp for a compiler that is not Apple's, else no OpenMP. `isa` (default `isa_level()`,
    i.e. $ROUTEFORMER_ISA): "native" compiles for this CPU, another level for that level's target
    (ValueError where this CPU cannot run it)."""
    isa = isa_level() if isa is None else isa
    if isa not in ISA_LEVELS:
        raise ValueError(f"isa={isa!r}; allowed: {', '.join(ISA_LEVELS)}")
    if isa == "native":
        arch, target = _native_target(compiler)
    else:
        arch = level_flags(compiler, isa)
        target = f"{isa} {' '.join(arch)} {platform.machine()}"
    plan = _platform_plan(compiler, arch, target)
    return BuildPlan(plan.flags, plan.openmp, plan.openmp_link, plan.target, plan.no_openmp, isa)


def _platform_plan(compiler: str, arch: tuple[str, ...], target: str) -> BuildPlan:
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


_WHY_NOT: dict[str, str] = {}  # "reason": why the last `load` gave no library
_BUILT: dict[str, str] = {}  # "isa": the ROUTEFORMER_ISA level the last `load` built for


def requested_isa() -> str | None:
    """The ROUTEFORMER_ISA level the last `load` built (or tried to build) for, else None."""
    return _BUILT.get("isa")


def why_not_built() -> str | None:
    """Why the library could not be built or loaded (after `load` returned None), else None."""
    return _WHY_NOT.get("reason")


def _fallback_warning(reason: str, detail: str = "") -> None:
    _WHY_NOT["reason"] = reason
    warnings.warn(f"routeformer: {reason}; the topk, expanding and meta row ops run in PyTorch (slower). "
                  f"Set ROUTEFORMER_NATIVE=0 to silence this.{' ' + detail if detail else ''}", stacklevel=4)


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, built on first use (cached per process); None where it cannot be
    built, after one warning saying why (`why_not_built` keeps the reason)."""
    if sys.platform in ("win32", "cygwin"):
        _fallback_warning("the native kernels are built on Linux and macOS only, not on Windows")
        return None
    compiler_ = compiler()
    if compiler_ is None:
        _fallback_warning("no C compiler found (install cc/gcc to build the native kernels)")
        return None
    try:
        plan = build_plan(compiler_)  # ValueError (raised): a ROUTEFORMER_ISA this CPU cannot run
    except (OSError, subprocess.SubprocessError) as failed:  # the compiler cannot be run at all
        _fallback_warning(f"the C compiler {compiler_!r} could not be run ({failed})")
        return None
    _BUILT["isa"] = plan.isa
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + plan.key_text(compiler_).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    error: Exception | None = None
    # A read-only home (some CI runners) falls back to the temporary directory.
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"routeformer-{_user_tag()}"):
        target = directory / f"routeformer_native_{plan.isa}_{key}.so"
        try:
            if not target.exists():
                without_openmp = _compile(compiler_, plan, target)
                if without_openmp is not None:
                    warnings.warn(f"routeformer: the native kernels were built without OpenMP "
                                  f"({without_openmp[-300:]}); they run on one thread. Install libomp "
                                  f"(macOS: brew install libomp) and delete {target} to rebuild with "
                                  "threads.", stacklevel=3)
            library = _declare(ctypes.CDLL(str(target)))
            _WHY_NOT.pop("reason", None)
            return library
        except subprocess.SubprocessError as failed:  # the compiler itself failed: no retry
            error = failed
            break
        except OSError as failed:
            error = failed
    detail = getattr(error, "stderr", "") or str(error)
    _fallback_warning("compiling the native kernels failed", detail[-2000:])
    return None
