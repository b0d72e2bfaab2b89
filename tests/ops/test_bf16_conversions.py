"""common.h's bfloat16 conversions (the storage format of the native kernels' bf16 paths) round
exactly as torch does: nearest even, NaN stays NaN, infinities and subnormals kept."""

import ctypes
import shutil
import subprocess

import pytest
import torch

from routeformer.ops.native import FLAGS, HEADER

PROBE = r"""
#include <stdint.h>
#include "common.h"
void narrow_scalar(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = float_to_bf16(x[i]);
}
void widen_scalar(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = bf16_to_float(x[i]);
}
int64_t has_vector(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
void narrow_vector(const float *x, uint16_t *y, int64_t n) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i + 16 <= n; i += 16) store_bf16_ps(y + i, _mm512_loadu_ps(x + i));
#endif
}
void widen_vector(const uint16_t *x, float *y, int64_t n) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, load_bf16_ps(x + i));
#endif
}
"""

compiler = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(compiler is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    (folder / "probe.c").write_text(PROBE)
    flags = [f for f in FLAGS if f != "-fopenmp"]
    source, library = folder / "probe.c", folder / "probe.so"
    subprocess.run([compiler, *flags, f"-I{HEADER.parent}", str(source), "-o", str(library)], check=True,
                   capture_output=True, text=True, timeout=300)
    return ctypes.CDLL(str(library))


def _values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e-39,
                            3.3895e38, 1.00390625, 1.01171875, 1.0078125 + 2**-20])  # ties and near-ties
    bits = torch.randint(0, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    random_floats = bits.view(torch.float32)  # every exponent, every rounding case
    values = torch.cat([special, random_floats, torch.randn(1000, generator=gen)])
    return values[: values.numel() // 16 * 16].contiguous()


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_narrowing_rounds_like_torch(probe, kind):
    if kind == "vector" and not probe.has_vector():
        pytest.skip("this CPU has no AVX-512")
    x = _values()
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    getattr(probe, f"narrow_{kind}")(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                     ctypes.c_int64(x.numel()))
    expected = x.to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_widening_is_exact(probe, kind):
    if kind == "vector" and not probe.has_vector():
        pytest.skip("this CPU has no AVX-512")
    x = _values().to(torch.bfloat16)
    y = torch.empty(x.shape, dtype=torch.float32)
    getattr(probe, f"widen_{kind}")(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                    ctypes.c_int64(x.numel()))
    assert torch.equal(y.view(torch.int32), x.float().view(torch.int32))

