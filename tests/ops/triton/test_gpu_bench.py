"""`routeformer bench gpu` at toy size: on CPU through Triton's interpreter (plumbing, not speed)."""

import pytest
import torch

from routeformer.bench.gpu_bench import markdown_table, run_gpu_bench


def test_gpu_bench_runs_every_mechanism_at_toy_size():
    rows = run_gpu_bench([24], batch=1, heads=2, head_dim=8, window=8, topk=4, routing_dim=4, landmarks=2,
                         block=8, repeats=1, flex=False, device="cpu", dtype=torch.float32)
    names = [row.name for row in rows]
    assert names[0] == "sdpa flash" and any(name.startswith("mita") for name in names)
    assert all(row.forward_ms > 0 and row.train_ms > 0 for row in rows)
    assert rows[0].forward_vs_sdpa == pytest.approx(1.0)
    table = markdown_table(rows)
    assert table.count("\n") == len(rows) + 1 and "topk(K=4)" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_bench_refuses_without_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        run_gpu_bench([1024])
