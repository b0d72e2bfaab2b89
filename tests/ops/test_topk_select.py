"""The routing kernels' selection (route_topk_keep_best_f32, topk_kernels.c): the m largest of n
candidate scores, ties to the lower key, moved to the front with their int64 keys, and the m-th
largest returned. Its passes differ per instruction set (AVX-512 16 lanes, AVX2 8 lanes with a
compress table, plain C), so lengths cover whole and partial vectors, and every level runs this
file (tests/ops/native/test_isa_levels.py)."""

from __future__ import annotations

import pytest
import torch

from routeformer.ops.native import kernel, native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="the native kernels are not built here")


def _keep_best(scores: torch.Tensor, keys: torch.Tensor, m: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    score, key = scores.clone().contiguous(), keys.clone().contiguous()
    padded_score = torch.cat([score, torch.full((16,), 7.0)])  # the buffers' spare entries hold garbage
    padded_key = torch.cat([key, torch.full((16,), -5, dtype=torch.long)])
    found = kernel("route_topk_keep_best_f32")(padded_score.data_ptr(), padded_key.data_ptr(), len(score), m)
    assert torch.equal(padded_score[len(score):], torch.full((16,), 7.0)), "wrote past n scores"
    assert torch.equal(padded_key[len(score):], torch.full((16,), -5, dtype=torch.long)), "wrote past n keys"
    return found, padded_score[:m], padded_key[:m]


def _expected(scores: torch.Tensor, keys: torch.Tensor, m: int) -> tuple[float, set]:
    order = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), int(keys[e])))[:m]
    return float(scores[order[-1]]), {(float(scores[e]), int(keys[e])) for e in order}


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 15, 16, 17, 31, 64, 65, 100, 129, 200, 263])
@pytest.mark.parametrize("ties", [False, True])
def test_keeps_the_m_best_with_their_keys_and_returns_the_mth(n, ties):
    gen = torch.Generator().manual_seed(n * 2 + ties)
    scores = torch.randn(n, generator=gen)
    if ties:  # few distinct values: the threshold ties past the m-th place
        scores = (scores * 2).round()
    keys = torch.randperm(4 * n, generator=gen)[:n] + (1 << 40)  # int64 keys beyond 32 bits
    for m in sorted({1, n // 3, n // 2, n - 1, n} - {0}):
        found, kept_scores, kept_keys = _keep_best(scores, keys, m)
        expected, members = _expected(scores, keys, m)
        assert found == expected, (n, m)
        assert {(float(s), int(k)) for s, k in zip(kept_scores, kept_keys, strict=True)} == members, (n, m)


def test_minus_infinity_scores_are_kept_last():
    scores = torch.tensor([1.0, float("-inf"), 3.0, float("-inf"), 2.0, 0.5, float("-inf"), 4.0, 5.0, -1.0])
    keys = torch.arange(10) * 3
    found, kept_scores, kept_keys = _keep_best(scores, keys, 7)
    assert found == -1.0
    assert sorted(kept_keys.tolist()) == [0, 6, 12, 15, 21, 24, 27]
