"""The C boundary (ops/native/boundary.py): every ctypes declaration of the package matches the C
prototype of its function (argument count, the kind of each argument, the return type), a wrong
declaration is refused with the function and the argument named, and the prototype reader agrees
with the compiler's own preprocessor."""

import ctypes
import importlib
import os
import pkgutil
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import routeformer.ops
from routeformer.ops import native
from routeformer.ops.native import DECLARED, FLAGS, SOURCES, boundary, c_reader, kernel, native_kernels
from routeformer.ops.native.boundary import CBoundaryError, c_prototypes, check, parse_sources

_PTR, _INT, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double


def _import_every_ops_module() -> None:
    """Every module of routeformer.ops, so that every `declare` of the package has run."""
    for module in pkgutil.walk_packages(routeformer.ops.__path__, "routeformer.ops."):
        try:
            importlib.import_module(module.name)
        except ImportError:  # optional backends (triton) absent here: they declare no C functions
            continue


def _kinds(prototypes):
    return {(p.returns, p.arguments) for p in prototypes}


def test_every_declared_kernel_matches_its_c_prototype():
    _import_every_ops_module()
    assert {"route_topk_f32", "band_attend_f64", "linear_rows_features_f32", "causal_linear_forward",
            "local_attend", "mita_route_f64", "rotary_f32"} <= set(DECLARED)
    for name, (restype, argtypes) in sorted(DECLARED.items()):
        check(name, restype, argtypes)  # raises CBoundaryError on a mismatch




def test_every_exported_function_is_declared_or_internal():
    """An exported C function either has a Python declaration or is a helper another C file calls
    (declared there, or in a header, with a prototype that the compiler does not check across
    files; see the next test)."""
    _import_every_ops_module()
    prototypes = c_prototypes()
    internal = {name for name, found in prototypes.items() if any(not p.defined for p in found)}
    assert set(prototypes) - set(DECLARED) - internal == set()
    assert set(DECLARED) - set(prototypes) == set()  # (check() says so too, with a message)


def test_the_prototypes_of_one_function_agree():
    """A function declared in one file and defined in another (the rf_linear_* helpers, the local_*
    row kernels, route_topk_keep_best_f32), or defined in both branches of an #if: one signature."""
    disagreeing = {name: [str(p) for p in found] for name, found in c_prototypes().items()
                   if len(_kinds(found)) > 1}
    assert disagreeing == {}
    assert any(len({p.source for p in found}) > 1 for found in c_prototypes().values())


_RIGHT = (None, [*[_PTR] * 7, *[_INT] * 6, _F64, _PTR, _I32])  # band_attend_f32, as band.py declares it


def _with(position, ctype):
    argtypes = list(_RIGHT[1])
    argtypes[position] = ctype
    return argtypes


@pytest.mark.parametrize(("restype", "argtypes", "message"), [
    (None, _RIGHT[1][:-1], r"15 arguments declared but C takes 16"),
    (None, [*_RIGHT[1], _I32], r"17 arguments declared but C takes 16"),
    (None, _with(15, _INT),
     r"argument 15 \(`int threads`\): ctypes c_(int64|long) \(int64\) but C takes int32"),
    (None, _with(7, _I32), r"argument 7 \(`int64_t rows`\): ctypes c_int \(int32\) but C takes int64"),
    (None, _with(13, ctypes.c_float), r"argument 13 .*: ctypes c_float \(float\) but C takes double"),
    (None, _with(0, _INT), r"argument 0 \(`const float \* q`\): .* but C takes pointer"),
    (None, _with(8, _PTR), r"argument 8 .*: ctypes c_void_p \(pointer\) but C takes int64"),
    (_INT, _RIGHT[1], r"return type: ctypes c_(int64|long) \(int64\) but C returns void"),
])
def test_a_wrong_declaration_is_refused(restype, argtypes, message):
    check("band_attend_f32", *_RIGHT)  # the right one passes
    with pytest.raises(CBoundaryError, match=message) as raised:
        check("band_attend_f32", restype, argtypes)
    assert "`band_attend_f32`" in str(raised.value)


def test_an_undeclared_or_unknown_function_is_refused():
    with pytest.raises(CBoundaryError, match="no exported C function `band_tile_float`"):
        check("band_tile_float", None, [])  # static in band_kernels.c: not callable from Python
    with pytest.raises(KeyError, match="no declaration"):
        kernel("not_a_kernel")


def test_declaring_twice_differently_is_refused(monkeypatch):
    monkeypatch.setattr(native, "DECLARED", dict(DECLARED))
    native.declare(None, [_PTR], "some_kernel_f32")
    native.declare(None, [_PTR], "some_kernel_f32")  # again, the same: fine
    with pytest.raises(ValueError, match="declared twice"):
        native.declare(None, [_INT], "some_kernel_f32")


@pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no C compiler here")
def test_kernel_checks_before_it_hands_out(monkeypatch):
    """`kernel` is the one way to a C function, and it checks: a wrong declaration never reaches a
    call (and does not touch the function's ctypes attributes)."""
    monkeypatch.setattr(native, "_KERNELS", {})
    wrong = (None, (*[_PTR] * 5, *[_INT] * 5, ctypes.c_float, _PTR, _I32))  # a float for `double sign`
    monkeypatch.setitem(DECLARED, "rotary_f32", wrong)
    with pytest.raises(CBoundaryError, match=r"`rotary_f32`(.|\n)*argument 10 \(`double sign`\)"):
        kernel("rotary_f32")


def test_prototypes_written_by_macros_and_templates(tmp_path):
    """The reader expands what the compiler expands: a template header included per type, a
    DEFINE_ macro with ## and #, both branches of an #if, and skips static functions, comments,
    attributes and function bodies."""
    (tmp_path / "twin_impl.h").write_text("""
        /* a template: T_ and SUFFIX defined by the includer */
        void RF_NAME(twin_)(const T_ *restrict x, int64_t n, T_ *y, double scale, int threads) {
            static_helper(x);
        }
    """)
    (tmp_path / "demo_kernels.c").write_text("""
        #include <stdint.h>
        #include "missing_system_like.h"
        #define RF_CAT_(a, b) a##b
        #define RF_CAT(a, b) RF_CAT_(a, b)
        #define RF_NAME(name) RF_CAT(name, SUFFIX)
        static inline void static_helper(const float *x) { (void)x; }
        // void commented_out(int64_t n);
        #define T_ float
        #define SUFFIX f32
        #include "twin_impl.h"
        #undef T_
        #undef SUFFIX
        #define T_ double
        #define SUFFIX f64
        #include "twin_impl.h"
        #define DEFINE_COUNT(NAME, I_) \\
            I_ NAME##_count(const uint8_t *mask[2], I_ length) { return length; } \\
            const char *NAME##_label(void) { return #NAME; }
        DEFINE_COUNT(rows, int64_t)
        #if defined(__AVX512F__)
        __attribute__((visibility("default"))) int64_t wide_available(void) { return 1; }
        #else
        int64_t wide_available(void) { return 0; }
        #endif
        typedef struct { float *data; int64_t size; } view;
        static view make_view(float *data) { view v = {data, 1}; return v; }
        float helper_defined_elsewhere(float x, unsigned long n);
    """)
    found = parse_sources((tmp_path / "demo_kernels.c",))
    assert set(found) == {"twin_f32", "twin_f64", "rows_count", "rows_label", "wide_available",
                          "helper_defined_elsewhere"}
    for suffix in ("f32", "f64"):
        (prototype,) = found[f"twin_{suffix}"]
        kinds = ("pointer", "int64", "pointer", "double", "int32")
        assert (prototype.returns, prototype.arguments) == ("void", kinds)
    assert _kinds(found["rows_count"]) == {("int64", ("pointer", "int64"))}
    assert _kinds(found["rows_label"]) == {("pointer", ())}
    assert len(found["wide_available"]) == 2 and _kinds(found["wide_available"]) == {("int64", ())}
    (elsewhere,) = found["helper_defined_elsewhere"]
    assert not elsewhere.defined and (elsewhere.returns, elsewhere.arguments) == ("float", ("float", "int64"))
    check("twin_f64", None, [_PTR, _INT, _PTR, _F64, _I32], found)
    with pytest.raises(CBoundaryError, match="argument 1"):
        check("twin_f64", None, [_PTR, _I32, _PTR, _F64, _I32], found)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def compiled_view() -> dict[str, list]:
    """The exported prototypes as the compiler sees them: each source through its preprocessor
    (-E, with the build's flags: #if evaluated for this CPU), then read by boundary's parser."""
    if _compiler() is None:
        pytest.skip("no C compiler here")
    flags = [flag for flag in FLAGS if flag not in ("-shared", "-fPIC") and not flag.startswith("-W")]
    directory = str(SOURCES[0].parent)
    view: dict[str, list] = {}
    for source in SOURCES:
        expanded = subprocess.run([_compiler(), *flags, "-E", str(source)], check=True, capture_output=True,
                                  text=True, timeout=120).stdout
        kept, keep = [], True
        for line in expanded.splitlines():  # only what the kernel sources and headers wrote
            marker = re.match(r'#\s*\d+\s+"([^"]*)"', line)
            if marker:
                keep = os.path.dirname(os.path.abspath(marker.group(1))) == directory
            elif keep and not line.startswith("#"):
                kept.append(line)
        tokens = c_reader.c_tokens(c_reader.strip_comments("\n".join(kept)))
        for prototype in boundary._declarations(tokens, source.name):
            view.setdefault(prototype.name, []).append(prototype)
    return view


def test_the_reader_agrees_with_the_compiler_preprocessor(compiled_view):
    """What the compiler sees of every exported function, the reader (which expands the macros
    itself and reads every #if branch) sees too, with the same kinds."""
    ours = c_prototypes()
    assert compiled_view and set(compiled_view) <= set(ours)
    for name, found in compiled_view.items():
        assert _kinds(found) <= _kinds(ours[name]), (found, ours[name])


@pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no C compiler here")
def test_every_declared_kernel_loads_declared(compiled_view):
    """Each declared function built for this CPU is handed out by `kernel` with its declaration;
    one defined only under an #if this CPU does not meet (AVX-512 BF16) is not in the library."""
    _import_every_ops_module()
    built = {name for name, found in compiled_view.items() if any(p.defined for p in found)}
    loaded = native.library()
    for name, (restype, argtypes) in sorted(DECLARED.items()):
        if name not in built:
            assert not hasattr(loaded, name), name
            continue
        function = kernel(name)
        assert function.restype is restype and tuple(function.argtypes) == argtypes, name


def test_template_headers_are_shipped():
    """The fp32/fp64 template headers (*_impl.h) are package data (pyproject's ops/native/*.h)
    and part of the build's cache key (every header beside the sources)."""
    pyproject = (Path(routeformer.ops.__file__).parents[3] / "pyproject.toml").read_text()
    assert '"ops/native/*.h"' in pyproject
    templates = sorted(SOURCES[0].parent.glob("*_impl.h"))
    assert templates and set(templates) <= set(native.HEADERS)


def test_every_kernel_call_site_names_a_declared_function():
    """Each `kernel("...")` / `kernel(f"...")` in routeformer.ops names a declared function (the
    f-string's fields read as any name part): a call site that runs only on some CPUs (AVX-512
    BF16) or dtypes is checked here too, wherever the tests run."""
    _import_every_ops_module()
    root = Path(routeformer.ops.__file__).parent
    sites = [(path.name, match.group(1)) for path in sorted(root.rglob("*.py"))
             for match in re.finditer(r'\bkernel\(f?"([^"]+)"', path.read_text())]
    assert len(sites) >= 20, sites
    for filename, name in sites:
        pattern = re.compile(re.sub(r"\\\{[^}]*\\\}", r"\\w+", re.escape(name)))
        assert any(pattern.fullmatch(declared) for declared in DECLARED), (filename, name)
