"""Every native kernel at every instruction-set level this CPU can run (ROUTEFORMER_ISA,
ops/native/build.py): the switch's validation and cache key, and — for each forced level the CPU
has (avx512, avx2, generic; native is what the rest of the suite runs) — a child pytest that builds
the library at that level and runs a representative set of native-vs-reference checks (values and
gradients) of each op family: local, linear, topk routing and routed attention, mita, rotary,
expanding, the band / linear rows of hard-routed meta, bf16 through every family.

The children start together (their builds overlap, ~15-35 s each at -O3) and share the session's
cache directory ($ROUTEFORMER_CACHE_DIR, else ~/.cache/routeformer): the cache key holds the level,
so each level builds once and later runs load it. `ROUTEFORMER_ISA_LEVELS=avx2,generic` runs
only those levels; `=none` runs none (CI on a machine that tests them in a separate job).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from routeformer.ops.native import build as native_build

ROOT = Path(__file__).resolve().parents[3]
FORCED = ("avx512", "avx2", "generic")
# One or more native-vs-reference checks per op family (values and gradients where the op has them).
CHECKS = (
    "tests/ops/native/test_isa_levels.py::test_the_library_is_built_at_the_requested_level",
    "tests/ops/test_local_native.py::test_fp32_matches_fp64_reference",
    "tests/ops/test_local_native.py::test_bf16_within_stated_tolerance_of_fp64",
    "tests/ops/test_local_native.py::test_padded_keys_may_hold_nan_and_rows_without_keys_are_zero",
    "tests/ops/test_linear_native.py::test_native_matches_the_fp64_reference",
    "tests/ops/test_topk_ops.py::test_route_topk_selects_the_reference_set",
    "tests/ops/test_topk_ops.py::test_routed_attention_matches_reference_forward_and_gradients",
    "tests/ops/test_topk_ops.py::test_float64_routing_selects_the_reference_set_in_both_scan_orders",
    "tests/ops/test_topk_ops.py::test_ties_go_to_the_lower_key_index",
    "tests/ops/test_topk_repeated.py::test_groups_select_what_the_reference_selects",
    "tests/ops/test_topk_select.py",  # the flush: 16-lane, 8-lane (compress table) and plain C passes
    # the speculative routing kernel: a bf16 prefilter at native (AVX-512 BF16), exact fp32 at avx512 and
    # avx2, absent (skipped) at generic
    "tests/ops/test_topk_speculative.py::test_float32_selects_what_the_tiled_kernel_selects",
    "tests/ops/test_topk_speculative.py::test_refuted_guesses_are_routed_again_exactly",
    "tests/ops/test_topk_speculative.py::test_ties_odd_dims_and_the_float32_reference",
    "tests/ops/test_topk_speculative.py::test_huge_and_nan_values_take_the_unguarded_path",
    "tests/ops/test_topk_speculative.py::test_bfloat16_is_read_as_stored_and_within_tolerance_of_fp64",
    "tests/ops/test_topk_speculative.py::test_crowded_rows_switch_to_the_exact_scan_and_select_the_same",
    "tests/ops/test_topk_speculative.py::test_the_index_is_the_same_on_one_thread_or_two_slot_order_included",
    "tests/ops/test_mita_native.py::test_routed_step_matches_its_pytorch_twin",
    "tests/ops/test_mita_native.py::test_inference_at_kernel_sizes_matches_the_reference",
    "tests/ops/test_rotary.py::test_rotary_matches_reference_forward_and_backward",
    "tests/ops/test_structural_ops.py::test_expanding_matches_reference",
    "tests/ops/test_structural_ops.py::test_expanding_fp32_matches_fp64",
    "tests/ops/test_routed_rows.py::test_rows_match_reference_forward_and_backward",
    "tests/ops/test_rows_fp32.py",
    "tests/ops/test_native_bf16.py",
)
_CHILD_TIMEOUT_S = 600


# -- the switch: values, refusals, cache key (no build) ---------------------------------------------

def test_unset_or_empty_means_native(monkeypatch):
    monkeypatch.delenv("ROUTEFORMER_ISA", raising=False)
    assert native_build.isa_level() == "native"
    monkeypatch.setenv("ROUTEFORMER_ISA", " AVX2 ")
    assert native_build.isa_level() == "avx2"
    monkeypatch.setenv("ROUTEFORMER_ISA", "")
    assert native_build.isa_level() == "native"


def test_an_unknown_level_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("ROUTEFORMER_ISA", "sse9")
    with pytest.raises(ValueError, match="ROUTEFORMER_ISA='sse9'.*native, avx512, avx2, generic"):
        native_build.isa_level()


def test_a_level_above_the_cpu_is_refused(monkeypatch):
    """A CPU with AVX2 only (Zen 2/3): avx512 is refused (its code would die of SIGILL), avx2 and
    generic are built for their fixed targets."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    zen3 = {"__AVX__", "__AVX2__", "__FMA__", "__BMI__", "__BMI2__", "__F16C__", "__LZCNT__", "__MOVBE__"}
    monkeypatch.setattr(native_build, "_macros", lambda compiler, flags: set(zen3))
    with pytest.raises(ValueError, match="ROUTEFORMER_ISA=avx512 needs AVX512F.*at most avx2"):
        native_build.level_flags("cc", "avx512")
    assert native_build.level_flags("cc", "avx2") == ("-march=x86-64-v3",)
    assert native_build.level_flags("cc", "generic") == ("-march=x86-64",)
    assert native_build.native_isa("cc") == "avx2"
    monkeypatch.setattr(native_build, "_macros", lambda compiler, flags: {"__AVX__", "__AVX2__"})  # no FMA
    with pytest.raises(ValueError, match="needs FMA, BMI"):
        native_build.level_flags("cc", "avx2")


def test_x86_levels_are_refused_off_x86_and_generic_has_no_march(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    for level in ("avx512", "avx2"):
        with pytest.raises(ValueError, match=f"ROUTEFORMER_ISA={level} is an x86-64 level.*aarch64"):
            native_build.level_flags("cc", level)
    assert native_build.level_flags("cc", "generic") == ()


def test_the_level_is_part_of_the_cache_key(monkeypatch):
    compiler = native_build.compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native_build, "_macros", lambda compiler, flags: {"__AVX512F__"} | set(
        native_build._LEVEL_MACROS["avx512"]))
    keys = {level: native_build.build_plan(compiler, level).key_text(compiler) for level in FORCED}
    assert len(set(keys.values())) == len(FORCED)
    assert all(f"isa={level}" in key for level, key in keys.items())
    assert "-march=x86-64-v3" in keys["avx2"] and "-march=x86-64-v4" in keys["avx512"]


def test_the_library_is_built_at_the_requested_level():
    """What the preprocessor compiled (isa_kernels.c) is the level asked for: a forced level exactly,
    native what -march=native has. (Also the first check of each child run below.)"""
    from routeformer.ops.native import compiled_isa, load

    if load() is None:
        if os.environ.get("ROUTEFORMER_ISA"):  # a forced level that did not build is a failure
            pytest.fail(f"ROUTEFORMER_ISA={os.environ['ROUTEFORMER_ISA']}: the library did not build: "
                        f"{native_build.why_not_built()}")
        pytest.skip("the native kernels are unavailable here")
    level, _ = compiled_isa()
    requested = native_build.isa_level()
    expected = native_build.native_isa(native_build.compiler()) if requested == "native" else requested
    assert level == expected
    # The speculative routing kernel: exact fp32 at the forced x86 levels (no AVX-512 BF16 there), none
    # at generic (route_topk_f32 serves).
    from routeformer.ops.native.topk import speculative_prefilter_exact, speculative_query_tile

    if requested in ("avx2", "avx512"):
        assert speculative_query_tile() > 0 and speculative_prefilter_exact()
    elif requested == "generic":
        assert speculative_query_tile() == 0


# -- every forced level the CPU has: build it and run the checks --------------------------------------

def _levels() -> list[str]:
    chosen = os.environ.get("ROUTEFORMER_ISA_LEVELS")
    levels = FORCED if chosen is None else tuple(x for x in chosen.split(",") if x and x != "none")
    return list(levels)


def _runnable(level: str) -> str | None:
    """None if this machine builds and runs `level`, else why not."""
    compiler = native_build.compiler()
    if compiler is None or sys.platform in ("win32", "cygwin"):
        return "no native build on this platform"
    try:
        native_build.level_flags(compiler, level)
    except ValueError as refused:
        return str(refused)
    return None


@pytest.fixture(scope="module")
def level_runs():
    """level -> the child pytest process of that level, all started at once (their builds overlap)."""
    runs = {}
    for level in _levels():
        if _runnable(level) is not None:
            continue
        environment = {**os.environ, "ROUTEFORMER_ISA": level, "ROUTEFORMER_ISA_LEVELS": "none",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                   os.environ.get("PYTHONPATH")]))}
        environment.pop("ROUTEFORMER_NATIVE", None)
        runs[level] = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *CHECKS], cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield runs
    for process in runs.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.timeout(_CHILD_TIMEOUT_S + 120)  # three library builds at once: minutes when loaded
@pytest.mark.parametrize("level", FORCED)
def test_native_ops_match_their_references_at_every_level(level, level_runs):
    if level not in _levels():
        pytest.skip(f"ROUTEFORMER_ISA_LEVELS={os.environ.get('ROUTEFORMER_ISA_LEVELS')} leaves {level} out")
    why_not = _runnable(level)
    if why_not is not None:
        pytest.skip(f"this machine cannot run {level}: {why_not}")
    try:
        output, _ = level_runs[level].communicate(timeout=_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        level_runs[level].kill()
        pytest.fail(f"the checks at ROUTEFORMER_ISA={level} ran past {_CHILD_TIMEOUT_S} s")
    assert level_runs[level].returncode == 0, f"ROUTEFORMER_ISA={level}:\n{output[-6000:]}"
    assert " passed" in output, output[-2000:]


# -- the portable sources for arm64 (a cross compiler where one is installed) --------------------------

_CROSS = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(_CROSS is None,
                    reason="no aarch64-linux-gnu-gcc (Debian: apt-get install gcc-aarch64-linux-gnu)")
def test_every_kernel_source_compiles_and_links_for_arm64(tmp_path):
    """The generic level is the one an ARM build gets: the whole library compiles for aarch64 (no
    x86 intrinsic outside its #if) and links with no undefined symbol (-z defs: a helper defined only
    under some #if would show here), with the flags of the real build."""
    compiled = subprocess.run([_CROSS, *native_build.BASE_FLAGS, "-shared", "-fopenmp", "-Wall",
                               *map(str, native_build.SOURCES), "-o", str(tmp_path / "arm64.so"), "-lm",
                               "-Wl,-z,defs"], capture_output=True, text=True, timeout=300)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
