"""The row kernels at inference in fp32 against the fp64 references: the banded C pass (full and
local rows) at head dims that are multiples of 16 (the AVX-512 value sums of band_kernels.c, one to
four 16-lane groups per pass, and a second pass past 64) and one that is not (the AVX2 fallback);
the linear rows with the feature map applied inside the kernel (vector exp, scalar tail)."""

import pytest
import torch

from routeformer.ops.native import native_kernels
from routeformer.ops.routed_rows import (
    full_attention_rows,
    full_attention_rows_reference,
    linear_attention_rows,
    linear_attention_rows_reference,
    local_attention_rows,
    local_attention_rows_reference,
    select_rows,
)

pytestmark = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no native kernels")


@pytest.mark.parametrize("value_dim", [16, 48, 64, 80, 24])
@pytest.mark.parametrize("expert", ["full", "local"])
def test_fp32_rows_match_the_fp64_reference(expert, value_dim):
    gen = torch.Generator().manual_seed(value_dim)
    batch, heads, length, dim = 2, 2, 300, 32
    q = torch.randn(batch, heads, length, dim, generator=gen)
    k = torch.randn(batch, heads, length, dim, generator=gen)
    v = torch.randn(batch, heads, length, value_dim, generator=gen)
    rows, valid = select_rows(torch.rand(batch, length, generator=gen) < 0.3)
    q_rows = q.gather(2, rows[:, None, :, None].expand(batch, heads, -1, dim))
    if expert == "full":
        with torch.no_grad():
            out, _ = full_attention_rows(q_rows, k, v, rows, valid)
        want = full_attention_rows_reference(q_rows.double(), k.double(), v.double(), rows, valid)
    else:
        with torch.no_grad():
            out, _ = local_attention_rows(q_rows, k, v, rows, valid, window=40)
        want = local_attention_rows_reference(q_rows.double(), k.double(), v.double(), rows, valid, window=40)
    real = valid[:, None, :, None]
    torch.testing.assert_close(out * real, (want * real).float(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dim", [64, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_rows_with_in_kernel_features_match_the_reference(dtype, dim):
    """No gradient wanted: phi = elu + 1 is applied by the kernel (keys read through strided head
    views of one projection, as in the layer); values as the dense reference's."""
    gen = torch.Generator().manual_seed(dim)
    batch, heads, length = 2, 3, 150
    projection = torch.randn(batch, length, 2 * heads * dim, generator=gen, dtype=dtype) * 2
    k, v = (t.unflatten(-1, (heads, dim)).transpose(1, 2) for t in projection.chunk(2, dim=-1))
    rows, valid = select_rows(torch.rand(batch, length, generator=gen) < 0.5)
    q_rows = torch.randn(batch, heads, rows.shape[1], dim, generator=gen, dtype=dtype) * 2
    with torch.no_grad():
        out, _ = linear_attention_rows(q_rows, k, v, rows, valid)
    want = linear_attention_rows_reference(q_rows.double(), k.double(), v.double(), rows, valid)
    real = valid[:, None, :, None]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(out * real, (want * real).to(dtype), atol=tolerance, rtol=tolerance)
