"""The native build on platforms this machine is not (ops/native/build.py): Windows, macOS with
and without libomp, a compiler that refuses OpenMP or -march=native, a compiler that fails, no
os.getuid — each simulated (monkeypatched `sys.platform` / `os`, a fake compiler script that logs
its arguments and writes an empty "library", a fake loader), so nothing is compiled here. The real
Linux build is what the rest of the suite runs on."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import textwrap
import warnings

import pytest
import torch

from routeformer.ops.native import build as native_build
from routeformer.ops.native import native_kernels

FAKE_COMPILER = textwrap.dedent("""\
    #!{python}
    # A stand-in C compiler. FAKE_CC_MODE (comma-separated): apple (an Apple clang), no-openmp
    # (refuses -fopenmp), no-march (refuses -march=native, takes -mcpu=native), broken (every
    # build fails); FAKE_CC_CPU: what -march=native resolves to. Each call is logged.
    import json, os, sys
    args, modes = sys.argv[1:], os.environ.get("FAKE_CC_MODE", "").split(",")
    with open(os.environ["FAKE_CC_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")
    if args == ["--version"]:
        print("Apple clang version 15.0.0" if "apple" in modes else "fake-cc 1.0")
        sys.exit(0)
    if "-###" in args:
        if "-march=native" in args and "no-march" in modes:
            print("error: unsupported option '-march=native'", file=sys.stderr)
            sys.exit(1)
        cpu = os.environ.get("FAKE_CC_CPU", "fakecpu")
        print(f' "/fake/cc1" "-target-cpu" "{{cpu}}" "-target-feature" "+avx2" '
              f'"-fdebug-compilation-dir={{os.getcwd()}}"', file=sys.stderr)
        sys.exit(0)
    if "broken" in modes:
        print("kernels.c:1: error: something is wrong", file=sys.stderr)
        sys.exit(1)
    plain_openmp = [i for i, arg in enumerate(args) if arg == "-fopenmp" and args[i - 1] != "-Xpreprocessor"]
    if plain_openmp and "no-openmp" in modes:
        print("clang: error: unsupported option '-fopenmp'", file=sys.stderr)
        sys.exit(1)
    with open(args[args.index("-o") + 1], "wb") as built:
        built.write(b"not really a library")
""")


class Build:
    """The fake compiler's log and the cache directory of one simulated build."""

    def __init__(self, tmp_path, monkeypatch):
        self.log = tmp_path / "cc.log"
        self.cache = tmp_path / "cache"
        compiler = tmp_path / "fake-cc"
        compiler.write_text(FAKE_COMPILER.format(python=sys.executable))
        compiler.chmod(0o755)
        monkeypatch.setenv("CC", str(compiler))
        monkeypatch.setenv("FAKE_CC_LOG", str(self.log))
        monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", str(self.cache))
        monkeypatch.delenv("ROUTEFORMER_LIBOMP", raising=False)
        monkeypatch.delenv("ROUTEFORMER_NATIVE", raising=False)
        monkeypatch.delenv("ROUTEFORMER_ISA", raising=False)  # a forced level would check the fake CPU
        self.loaded: list[str] = []

        def fake_library(path):  # what ctypes would load: record it, declare nothing
            self.loaded.append(path)
            return path

        monkeypatch.setattr(ctypes, "CDLL", fake_library)
        monkeypatch.setattr(native_build, "_declare", lambda library: library)

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def builds(self) -> list[list[str]]:
        return [call for call in self.calls() if "-o" in call and "-###" not in call]

    def libraries(self) -> list[str]:
        return sorted(path.name for path in self.cache.glob("*.so"))


@pytest.fixture
def build(tmp_path, monkeypatch):
    native_build.load.cache_clear()
    yield Build(tmp_path, monkeypatch)
    native_build.load.cache_clear()


def load_with_warnings():
    """(native_build.load()'s result, the routeformer warnings it gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = native_build.load()
    return library, [str(w.message) for w in caught if "routeformer" in str(w.message)]


def test_linux_builds_with_march_native_and_openmp(build, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    library, said = load_with_warnings()
    assert said == [] and library == build.loaded[0]
    (args,) = build.builds()
    assert "-march=native" in args and "-fopenmp" in args and "-shared" in args
    native_build.load.cache_clear()
    assert native_build.load() == library and len(build.builds()) == 1  # the cached library: no rebuild


def test_the_cache_key_holds_what_march_native_resolves_to(build, monkeypatch):
    """Two CPUs of one machine type (same /proc/cpuinfo here, a shared cache directory) that the
    compiler resolves differently get two libraries; a cwd change (in the driver's listing) none."""
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("FAKE_CC_CPU", "cpu-a")
    native_build.load()
    native_build.load.cache_clear()
    monkeypatch.chdir(build.cache)
    native_build.load()
    assert len(build.libraries()) == 1
    native_build.load.cache_clear()
    monkeypatch.setenv("FAKE_CC_CPU", "cpu-b")
    native_build.load()
    assert len(build.libraries()) == 2


def test_a_compiler_refusing_march_native_builds_with_mcpu_native(build, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("FAKE_CC_MODE", "no-march")
    library, said = load_with_warnings()
    assert said == [] and library is not None
    (args,) = build.builds()
    assert "-mcpu=native" in args and "-march=native" not in args


def test_a_compiler_without_openmp_builds_without_it_and_says_so_once(build, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("FAKE_CC_MODE", "no-openmp")
    library, said = load_with_warnings()
    assert library is not None and len(said) == 1
    assert "without OpenMP" in said[0] and "one thread" in said[0]
    assert "unsupported option '-fopenmp'" in said[0]
    first, second = build.builds()
    assert "-fopenmp" in first and "-fopenmp" not in second


def test_a_failing_compiler_falls_back_to_pytorch_with_one_warning(build, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("FAKE_CC_MODE", "broken")
    library, said = load_with_warnings()
    assert library is None and len(said) == 1
    assert "compiling the native kernels failed" in said[0] and "run in PyTorch" in said[0]
    assert "something is wrong" in said[0]
    assert len(build.builds()) == 1  # not OpenMP's fault: no second build
    assert native_kernels(torch.zeros(1)) is None  # cached: no second warning, PyTorch path


def test_macos_with_libomp_builds_apple_clang_with_it(build, monkeypatch, tmp_path):
    prefix = tmp_path / "libomp"
    (prefix / "include").mkdir(parents=True)
    (prefix / "include" / "omp.h").write_text("")
    (prefix / "lib").mkdir()
    monkeypatch.setenv("ROUTEFORMER_LIBOMP", str(prefix))
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("FAKE_CC_MODE", "apple,no-openmp")  # Apple clang refuses a plain -fopenmp
    library, said = load_with_warnings()
    assert said == [] and library is not None
    (args,) = build.builds()
    assert args[args.index("-fopenmp") - 1] == "-Xpreprocessor" and f"-I{prefix}/include" in args
    assert "-lomp" in args and f"-L{prefix}/lib" in args and "-dynamiclib" in args


def test_macos_without_libomp_builds_one_threaded_and_says_so_once(build, monkeypatch, tmp_path):
    nowhere = ((str(tmp_path / "none/include"), str(tmp_path / "none/lib")),)
    monkeypatch.setattr(native_build, "_LIBOMP_PLACES", nowhere)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("FAKE_CC_MODE", "apple,no-openmp")
    library, said = load_with_warnings()
    assert library is not None and len(said) == 1 and "without OpenMP" in said[0] and "libomp" in said[0]
    (args,) = build.builds()
    assert not {"-fopenmp", "-Xpreprocessor", "-lomp"} & set(args)


def test_windows_falls_back_to_pytorch_with_one_warning(build, monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delattr(os, "getuid", raising=False)  # as on Windows
    library, said = load_with_warnings()
    assert library is None and len(said) == 1 and "Windows" in said[0] and "run in PyTorch" in said[0]
    assert build.calls() == []  # no compiler is run
    from routeformer.ops.mita import mita_attention, mita_reference

    q, k, v = (torch.randn(1, 2, 24, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        torch.testing.assert_close(mita_attention(q, k, v, landmarks=3, topk=4).out,
                                   mita_reference(q, k, v, landmarks=3, topk=4))


def test_no_getuid_reaches_the_temporary_cache_directory(build, monkeypatch, tmp_path):
    """A cache directory that cannot be made sends the build to the temporary directory, named
    without os.getuid where the platform has none (it ran before the `try` once: AttributeError)."""
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delattr(os, "getuid", raising=False)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", str(blocked / "cache"))  # mkdir fails: a file above
    monkeypatch.setattr(native_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    library, said = load_with_warnings()
    assert said == [] and library is not None
    assert build.loaded[0].startswith(str(tmp_path / "tmp" / "routeformer-"))
    assert native_build._user_tag()


def test_a_compiler_that_cannot_run_falls_back_with_one_warning(build, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    library, said = load_with_warnings()
    assert library is None and len(said) == 1 and "could not be run" in said[0]
