"""`routeformer bench gpu`: the routed ops on a CUDA GPU against SDPA's flash backend and
FlexAttention, bf16, causal, forward and forward+backward time and peak memory.

Rows per length T (B, H, d from the command line):
- `sdpa flash`: `scaled_dot_product_attention` restricted to the flash backend (the baseline;
  skipped above `--sdpa-up-to` where it would take minutes);
- `flex local(w)`: FlexAttention (torch.compile'd) with a causal sliding-window block mask;
- `local(w)`: routeformer's `local_attention` (blockwise PyTorch on CUDA: it has no Triton kernel);
- `topk(K)`: `route_topk` (r = `--routing-dim`) then `routed_attention` — the Triton kernels;
  `topk routing` and `topk attention` time the two halves;
- `mita causal`: `mita_attention(causal=True, route=2)` — routed experts and merges on Triton;
- `expanding causal`: `expanding_attention` with a Beta(1, 20) prior — inference steps in PyTorch
  (the ring band path), the final pass on Triton.

Ratios are against SDPA flash measured in the same run (implementations alternate, median of
`--repeats`); peak memory is the CUDA allocator's extra peak for one forward+backward. On a machine
without CUDA the command refuses; `run_gpu_bench(device="cpu")` runs the same code at toy size
through Triton's interpreter (the test does), which checks the plumbing, never the speed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from routeformer.bench.timing import machine_description, median_times, peak_memory_mib


@dataclass
class GpuRow:
    name: str
    length: int
    forward_ms: float
    train_ms: float  # forward + backward
    peak_mib: float | None
    forward_vs_sdpa: float | None  # SDPA time / this time (> 1: faster than SDPA)
    train_vs_sdpa: float | None


def _inputs(batch: int, heads: int, length: int, head_dim: int, device: str, dtype: torch.dtype, seed: int):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, heads, length, head_dim)
    return [torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_() for _ in range(3)]


def _sdpa_flash(q, k, v):
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _flex_local(length: int, window: int, device: str) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    block_mask = create_block_mask(sliding, None, None, length, length, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _mechanisms(length: int, *, window: int, topk: int, routing_dim: int, landmarks: int, block: int,
                device: str, dtype: torch.dtype, flex: bool, sdpa: bool, batch: int, heads: int):
    from routeformer.ops.expanding import expanding_attention
    from routeformer.ops.local import local_attention
    from routeformer.ops.mita import mita_attention
    from routeformer.ops.topk import route_topk, routed_attention

    generator = torch.Generator(device="cpu").manual_seed(1)
    route_q, route_k = (torch.randn(batch, 1, length, routing_dim, generator=generator).to(device, dtype)
                        for _ in range(2))
    routing = lambda: route_topk(route_q, route_k, topk, causal=True)
    index, valid, _ = routing()

    def topk_whole(q, k, v):
        chosen, ok, _ = routing()
        return routed_attention(q, k, v, chosen.expand(-1, q.shape[1], -1, -1),
                                ok.expand(-1, q.shape[1], -1, -1))[0]

    ops: dict[str, Callable] = {}
    if sdpa:
        ops["sdpa flash"] = _sdpa_flash
    if flex:
        ops[f"flex local(w={window})"] = _flex_local(length, window, device)
    ops[f"local(w={window})"] = lambda q, k, v: local_attention(q, k, v, window=window, causal=True)
    ops[f"topk(K={topk})"] = topk_whole
    ops["topk routing"] = lambda q, k, v: routing()[0]
    ops["topk attention"] = lambda q, k, v: routed_attention(
        q, k, v, index.expand(-1, q.shape[1], -1, -1), valid.expand(-1, q.shape[1], -1, -1))[0]
    ops[f"mita causal(E={landmarks},K={topk},R=2)"] = lambda q, k, v: mita_attention(
        q, k, v, landmarks=landmarks, topk=topk, route=2, causal=True, block=block).out
    # Expanding attention's prior: Beta(1, 20) starts each query at a window of 95 keys (tol 0.01).
    alpha, beta = (torch.full((heads,), value, device=device) for value in (1.0, 20.0))
    ops["expanding causal"] = lambda q, k, v: expanding_attention(q, k, v, alpha, beta, causal=True).out
    return ops


def run_gpu_bench(lengths: list[int], *, batch: int = 1, heads: int = 8, head_dim: int = 64,
                  window: int = 256, topk: int = 64, routing_dim: int = 16, landmarks: int = 16,
                  block: int = 256,
                  repeats: int = 5, sdpa_up_to: int = 131072, flex: bool = True, device: str = "cuda",
                  dtype: torch.dtype = torch.bfloat16) -> list[GpuRow]:
    """Time every mechanism at every length (see the module docstring); returns the rows."""
    from routeformer.ops.backends import force_triton

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("routeformer bench gpu needs a CUDA GPU (none is visible); the Triton kernels' "
                         "correctness is tested on CPU by tests/ops/triton")
    rows: list[GpuRow] = []
    with force_triton(device == "cpu"):  # CPU: the Triton kernels through the interpreter (toy sizes)
        for length in lengths:
            q, k, v = _inputs(batch, heads, length, head_dim, device, dtype, seed=length)
            ops = _mechanisms(length, window=window, topk=topk, routing_dim=routing_dim, landmarks=landmarks,
                              block=block, device=device, dtype=dtype, flex=flex,
                              sdpa=length <= sdpa_up_to, batch=batch, heads=heads)

            def forward(op, inputs=(q, k, v)):
                def run():
                    with torch.no_grad():
                        op(*inputs)
                return run

            def train(op, inputs=(q, k, v)):
                def run():
                    out = op(*inputs)
                    if out.requires_grad:
                        out.float().sum().backward()
                    for tensor in inputs:
                        tensor.grad = None
                return run

            forward_times = median_times({name: forward(op) for name, op in ops.items()}, repeats)
            train_times = median_times({name: train(op) for name, op in ops.items()}, repeats)
            for name, op in ops.items():
                base_f, base_t = forward_times.get("sdpa flash"), train_times.get("sdpa flash")
                rows.append(GpuRow(
                    name, length, 1e3 * forward_times[name], 1e3 * train_times[name],
                    peak_memory_mib(train(op)) if device == "cuda" else None,
                    None if base_f is None else base_f / forward_times[name],
                    None if base_t is None else base_t / train_times[name]))
    return rows


def markdown_table(rows: list[GpuRow]) -> str:
    fmt = lambda value, spec: "—" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)
    lines = ["| mechanism | T | fwd ms | fwd+bwd ms | peak MiB | fwd vs SDPA | fwd+bwd vs SDPA |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.name} | {row.length} | {row.forward_ms:.2f} | {row.train_ms:.2f} | "
                     f"{fmt(row.peak_mib, '.0f')} | {fmt(row.forward_vs_sdpa, '.2f')}x | "
                     f"{fmt(row.train_vs_sdpa, '.2f')}x |")
    return "\n".join(lines)


def command_gpu(args) -> int:
    """The CLI entry: `routeformer bench gpu --lengths 4096 16384 32768 65536 131072 [--output F]`."""
    rows = run_gpu_bench(args.lengths, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                         window=args.window, topk=args.topk, routing_dim=args.routing_dim,
                         landmarks=args.landmarks, repeats=args.repeats, sdpa_up_to=args.sdpa_up_to,
                         flex=not args.no_flex)
    gpu = torch.cuda.get_device_name()
    header = (f"GPU benchmark, bf16, causal, B={args.batch}, H={args.heads}, d={args.head_dim}; {gpu}; "
              f"{machine_description()}")
    table = markdown_table(rows)
    print(header + "\n\n" + table, flush=True)
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{header}\n\n{table}\n")
        path.with_suffix(".json").write_text(json.dumps([asdict(row) for row in rows], indent=2))
    return 0
