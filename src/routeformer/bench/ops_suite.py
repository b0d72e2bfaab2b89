"""`routeformer bench ops`: the routed ops against scaled_dot_product_attention, FlexAttention and
this machine's matmul peak, in fp32 and bf16.

Ops (causal, q, k, v [B, H, T, d]): SDPA (the baseline), local (window w, blockwise SDPA),
FlexAttention's compiled sliding window (forward only: its CPU backward is not implemented),
causal linear attention (chunked), and top-k routing (route in r dims with `route_topk`, then
exact attention over K keys with `routed_attention`; the C kernels where a compiler exists), with
its two halves also timed alone (where its time goes).

Every figure of one length comes from the same alternating rounds (all ops and both dtypes take
turns, `median_times`), so the ratios compare like with like on a noisy machine:
- speed-up vs SDPA = SDPA time / op time, same dtype (> 1: the op is faster);
- speed-up vs Flex = Flex time / op time (local only: the fixed-mask pattern Flex serves);
- bf16 speed-up = fp32 time / bf16 time of the same op (> 1: bf16 is faster);
- executed FLOPs: what the op computes for the call, masked work it still computes included
  (ops/*_flops; Flex: its block mask's non-empty 128x128 blocks; top-k: routing products
  2·scored·r plus attention over the K slots); forward only. The fraction of peak divides the
  op's FLOP/s by the matmul peak of its dtype (`dtype_peaks`): a [1024 x 1024] @ [1024 x 1024]
  matmul timed in the same rounds and threads, in that dtype or in fp32, whichever is faster (a
  CPU without bf16 instructions runs bf16 ops in fp32 arithmetic, while its bf16 matmul falls far
  below what the fp32 units do, so the bf16 matmul alone is no peak there). A fraction over 100 %
  is a measuring error and is reported as one, not as a percentage. For fwd+bwd the FLOPs are
  counted as 3x the forward's (the backward's matmuls are twice the forward's; recomputation not
  counted), a convention, not a count.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from routeformer.bench.ops_bench import forward_backward_call, forward_call
from routeformer.bench.timing import machine_description, median_times, peak_memory_mib
from routeformer.ops import linear_attention, local_attention, route_topk, routed_attention
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.full import full_attention_flops
from routeformer.ops.linear import linear_attention_flops
from routeformer.ops.local import local_attention_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OP_FAMILIES = ("local", "linear", "topk")  # `--ops`: time only these beside SDPA
BACKWARD_FLOPS_FACTOR = 3  # fwd+bwd FLOPs = 3 x forward (see the module docstring)


@dataclass
class Op:
    name: str
    run: Callable  # (q, k, v) -> out
    flops: int  # executed forward FLOPs
    backward: bool = True


@dataclass
class SuiteRow:
    length: int
    dtype: str
    op: str
    forward_ms: float
    forward_backward_ms: float | None
    forward_vs_sdpa: float
    forward_backward_vs_sdpa: float | None
    forward_vs_flex: float | None
    bf16_speedup_forward: float | None
    bf16_speedup_forward_backward: float | None
    forward_gflop: float
    forward_gflops_per_s: float
    forward_peak_fraction: float
    forward_backward_peak_fraction: float | None
    forward_peak_mib: float | None
    forward_backward_peak_mib: float | None


MATMUL_SIZE = 1024


def dtype_peaks(matmul_gflops: dict[str, float]) -> dict[str, float]:
    """The matmul peak (GFLOP/s) each dtype's fraction divides by: the faster of that dtype's matmul
    and the fp32 matmul, from `matmul_gflops` {dtype name: GFLOP/s} of the same rounds."""
    return {name: max(rate, matmul_gflops["fp32"]) for name, rate in matmul_gflops.items()}


def percent_of_peak(fraction: float | None) -> str:
    """A fraction of peak as the table prints it: "–" when absent, a flagged measuring error when over
    1 (an op cannot run faster than the machine's matmul peak), else a percentage."""
    if fraction is None:
        return "–"
    if fraction > 1:
        return f"over peak ({100 * fraction:.0f}%): measuring error"
    return f"{100 * fraction:.0f}%"


def matmul_call(dtype: torch.dtype, size: int = MATMUL_SIZE) -> Callable[[], object]:
    """A square matmul into a reused buffer (no fresh-allocation page faults): 2·size³ FLOPs."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty(size, size, dtype=dtype)
    return lambda: torch.matmul(a, b, out=out)


def _flex_local(length: int, window: int, heads: int, batch: int, head_dim: int) -> tuple[Callable, int]:
    """FlexAttention (torch.compile'd) with a causal sliding-window block mask, and the FLOPs its
    block-sparse kernel executes (every non-empty block in full)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def in_window(b, h, q_index, kv_index):
        return (q_index >= kv_index) & (q_index - kv_index < window)

    mask = create_block_mask(in_window, None, None, length, length, device="cpu")
    blocks = int(mask.kv_num_blocks.sum()) + (0 if mask.full_kv_num_blocks is None
                                              else int(mask.full_kv_num_blocks.sum()))
    pairs = blocks * mask.BLOCK_SIZE[0] * mask.BLOCK_SIZE[1]
    compiled = torch.compile(flex_attention, dynamic=False)
    flops = batch * heads * dense_attention_flops(pairs, head_dim)
    return (lambda q, k, v: compiled(q, k, v, block_mask=mask)), flops


def op_list(length: int, *, batch: int, heads: int, head_dim: int, window: int, topk: int,
            routing_dim: int, flex: bool = True, families: Sequence[str] | None = None) -> list[Op]:
    """The timed ops; `families` (a subset of OP_FAMILIES) keeps only those ops beside SDPA (Flex
    comes with local)."""
    unknown = sorted(set(families or ()) - set(OP_FAMILIES))
    if unknown:
        raise ValueError(f"ops: unknown op family {unknown}; allowed: {', '.join(OP_FAMILIES)}")
    dense_flops = full_attention_flops(batch, heads, length, length, head_dim, causal=True)
    gen = torch.Generator().manual_seed(length + 1)
    route_q, route_k = (torch.randn(batch, heads, length, routing_dim, generator=gen) for _ in range(2))
    _, _, scored = route_topk(route_q, route_k, topk, causal=True)

    def topk_attention(q, k, v):
        index, valid, _ = route_topk(route_q.to(q.dtype), route_k.to(q.dtype), topk, causal=True)
        return routed_attention(q, k, v, index, valid)[0]

    ops = [
        Op("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), dense_flops),
        Op(f"local(w={window})", lambda q, k, v: local_attention(q, k, v, window=window, causal=True),
           local_attention_flops(batch, heads, length, head_dim, window, causal=True)),
        Op("linear", lambda q, k, v: linear_attention(q, k, v, causal=True),
           linear_attention_flops(batch, heads, length, head_dim, head_dim, causal=True)),
        Op(f"topk(K={topk},r={routing_dim})", topk_attention,
           2 * scored * routing_dim + 2 * batch * heads * length * min(topk, length) * 2 * head_dim),
    ]
    # Where top-k's time goes: the routing alone, and the attention over a fixed routing.
    index, valid, _ = route_topk(route_q, route_k, topk, causal=True)
    ops += [
        Op("  topk: routing only", lambda q, k, v: route_topk(route_q.to(q.dtype), route_k.to(q.dtype), topk,
                                                              causal=True)[0],
           2 * scored * routing_dim, backward=False),
        Op("  topk: attention only", lambda q, k, v: routed_attention(q, k, v, index, valid)[0],
           2 * batch * heads * length * min(topk, length) * 2 * head_dim),
    ]
    if flex:
        ops.insert(2, Op(f"flex local(w={window})", *_flex_local(length, window, heads, batch, head_dim),
                         backward=False))
    if families:
        ops = [op for op in ops if op.name == "sdpa"
               or any(op.name.strip().removeprefix("flex ").startswith(f) for f in families)]
    return ops


def bench_ops_suite(
    lengths: list[int], *, repeats: int = 5, window: int = 256, batch: int = 1, heads: int = 4,
    head_dim: int = 64, topk: int = 64, routing_dim: int = 16, flex: bool = True,
    families: Sequence[str] | None = None, progress: Callable[[str], None] = print,
) -> tuple[list[SuiteRow], dict[str, dict[str, float]]]:
    """Rows per (length, dtype, op) and the matmul peaks (GFLOP/s per length and dtype). The peak
    is timed inside the same alternating rounds as the ops (a loaded machine's speed drifts)."""
    rows, all_peaks = [], {}
    matmuls = {("matmul", name): matmul_call(dtype) for name, dtype in DTYPES.items()}
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        base = [torch.randn(batch, heads, length, head_dim, generator=gen) for _ in range(3)]
        ops = op_list(length, batch=batch, heads=heads, head_dim=head_dim, window=window, topk=topk,
                      routing_dim=routing_dim, flex=flex, families=families)
        inputs = {name: tuple(t.to(dtype) for t in base) for name, dtype in DTYPES.items()}
        leaves = {name: tuple(t.clone().requires_grad_() for t in ts) for name, ts in inputs.items()}
        forward = median_times({**matmuls, **{(d, op.name): forward_call(op.run, inputs[d])
                                              for d in DTYPES for op in ops}}, repeats)
        peaks = dtype_peaks({d: 2 * MATMUL_SIZE**3 / forward[("matmul", d)] / 1e9 for d in DTYPES})
        all_peaks[str(length)] = peaks
        progress(f"T={length}: matmul peak GFLOP/s " + ", ".join(f"{d} {v:.0f}" for d, v in peaks.items()))
        both = median_times({**matmuls, **{(d, op.name): forward_backward_call(op.run, leaves[d])
                                           for d in DTYPES for op in ops if op.backward}}, repeats)
        # The fwd+bwd fractions divide by the peak of their own rounds.
        peaks_both = dtype_peaks({d: 2 * MATMUL_SIZE**3 / both[("matmul", d)] / 1e9 for d in DTYPES})
        all_peaks[f"{length} fwd+bwd rounds"] = peaks_both
        for dtype in DTYPES:
            for op in ops:
                rows.append(_row(length, dtype, op, forward, both, (peaks[dtype], peaks_both[dtype]),
                                 inputs[dtype], leaves[dtype],
                                 flex_name=f"flex local(w={window})", local_name=f"local(w={window})"))
                progress(format_row(rows[-1]))
    return rows, all_peaks


def _row(length, dtype, op, forward, both, peak, inputs, leaves, *, flex_name, local_name) -> SuiteRow:
    fwd = forward[(dtype, op.name)]
    fwd_bwd = both.get((dtype, op.name))
    sdpa_both = both[(dtype, "sdpa")]
    peak, peak_both = peak  # the matmul peaks of the forward rounds and of the fwd+bwd rounds
    rate = op.flops / fwd / 1e9
    return SuiteRow(
        length=length, dtype=dtype, op=op.name, forward_ms=1e3 * fwd,
        forward_backward_ms=None if fwd_bwd is None else 1e3 * fwd_bwd,
        forward_vs_sdpa=forward[(dtype, "sdpa")] / fwd,
        forward_backward_vs_sdpa=None if fwd_bwd is None else sdpa_both / fwd_bwd,
        forward_vs_flex=(forward[(dtype, flex_name)] / fwd
                         if op.name == local_name and (dtype, flex_name) in forward else None),
        bf16_speedup_forward=(forward[("fp32", op.name)] / forward[("bf16", op.name)] if dtype == "bf16"
                              else None),
        bf16_speedup_forward_backward=(both[("fp32", op.name)] / both[("bf16", op.name)]
                                       if dtype == "bf16" and fwd_bwd is not None else None),
        forward_gflop=op.flops / 1e9, forward_gflops_per_s=rate, forward_peak_fraction=rate / peak,
        forward_backward_peak_fraction=(None if fwd_bwd is None
                                        else BACKWARD_FLOPS_FACTOR * op.flops / fwd_bwd / 1e9 / peak_both),
        forward_peak_mib=peak_memory_mib(forward_call(op.run, inputs)),
        forward_backward_peak_mib=(peak_memory_mib(forward_backward_call(op.run, leaves)) if op.backward
                                   else None),
    )


HEADER = ("| T | dtype | op | fwd ms | fwd speed-up vs SDPA | fwd speed-up vs Flex | fwd+bwd ms | "
          "fwd+bwd speed-up vs SDPA | bf16 speed-up fwd / fwd+bwd | fwd GFLOP | fwd GFLOP/s | "
          "fwd % of matmul peak | fwd+bwd % of peak | fwd / fwd+bwd peak MiB |\n|" + "---|" * 14)


def format_row(row: SuiteRow) -> str:
    def number(value, fmt, unit=""):
        return "–" if value is None else format(value, fmt) + unit

    bf16 = ("–" if row.bf16_speedup_forward is None else
            f"{row.bf16_speedup_forward:.2f}x / {number(row.bf16_speedup_forward_backward, '.2f', 'x')}")
    both_fraction = row.forward_backward_peak_fraction
    return " | ".join([
        f"| {row.length}", row.dtype, row.op, f"{row.forward_ms:.1f}", f"{row.forward_vs_sdpa:.2f}x",
        number(row.forward_vs_flex, ".2f", "x"), number(row.forward_backward_ms, ".1f"),
        number(row.forward_backward_vs_sdpa, ".2f", "x"), bf16, f"{row.forward_gflop:.2f}",
        f"{row.forward_gflops_per_s:.1f}", percent_of_peak(row.forward_peak_fraction),
        percent_of_peak(both_fraction),
        f"{number(row.forward_peak_mib, '.0f')} / {number(row.forward_backward_peak_mib, '.0f')}"]) + " |"


def write_report(rows: list[SuiteRow], peaks: dict[str, dict[str, float]], output: Path,
                 command: str, load: tuple[float, float] | None = None) -> None:
    """`load`: the 1-minute load average when the timing started and when it ended (this job counts
    about 1 on its own): how busy the machine was, stated rather than assumed."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    busy = "" if load is None else (
        f" 1-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at the end (this job "
        "alone counts about 1); the ratios, measured in alternating rounds, are fairer than the times.")
    lines = [
        "# Ops benchmark", "",
        f"Measured {now} on {machine_description()}. Command: `{command}`.{busy}", "",
        "Matmul peak ([1024 x 1024] @ [1024 x 1024], timed in the same alternating rounds as the "
        "forward passes, and again in the fwd+bwd rounds; a dtype's peak is the faster of its own matmul "
        "and the fp32 one), GFLOP/s: "
        + "; ".join(f"T={length}: fp32 {p['fp32']:.0f}, bf16 {p['bf16']:.0f}" for length, p in peaks.items())
        + ".", "",
        "Conventions (routeformer/bench/ops_suite.py): speed-up = baseline time / op time (> 1: the op "
        "is faster), baseline SDPA or FlexAttention in the same dtype; bf16 speed-up = fp32 time / bf16 "
        "time of the op; FLOPs are the executed forward FLOPs; fwd+bwd % of peak counts 3x the forward "
        "FLOPs. Medians of alternating repetitions (all ops and both dtypes take turns).", "",
        HEADER, *[format_row(row) for row in rows], ""]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines))
    output.with_suffix(".json").write_text(json.dumps(
        {"command": command, "measured": now, "machine": machine_description(), "matmul_peak_gflops": peaks,
         "rows": [asdict(row) for row in rows]}, indent=2))


def command_ops(args) -> int:
    """`routeformer bench ops` (the CLI's arguments): print the table, write it with --output."""
    output = None
    if args.output:  # fail before minutes of timing, not after
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    load_at_start = os.getloadavg()[0]
    rows, peaks = bench_ops_suite(args.lengths, repeats=args.repeats, window=args.window, batch=args.batch,
                                  heads=args.heads, head_dim=args.head_dim, topk=args.topk,
                                  routing_dim=args.routing_dim, flex=not args.no_flex,
                                  families=args.ops, progress=lambda line: print(line, flush=True))
    if output is not None:
        command = " ".join([
            "routeformer bench ops --lengths", *map(str, args.lengths), f"--repeats {args.repeats}",
            f"--window {args.window} --batch {args.batch} --heads {args.heads} --head-dim {args.head_dim}",
            f"--topk {args.topk} --routing-dim {args.routing_dim}", *(["--no-flex"] if args.no_flex else []),
            *(["--ops", *args.ops] if args.ops else [])])
        write_report(rows, peaks, output, command, load=(load_at_start, os.getloadavg()[0]))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0
