"""`routeformer bench mita`: the mita op (non-causal and causal) against SDPA, and its scaling.

Non-causal MiTA is compared with non-causal SDPA and causal MiTA with causal SDPA, each pair timed
in the same `bench_ops` round. SDPA is left out above `sdpa_up_to` tokens (quadratic: minutes
per call), causal MiTA above `causal_up_to` (its own-block term grows as N²/E). The scaling table
reports time and peak memory per token, which are flat when the op is linear in N.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch.nn.functional as F

from routeformer.bench.ops_bench import OpsRow, bench_ops
from routeformer.ops.mita import mita_attention


def mita_op_table(
    landmarks: int, topk: int, causal: bool, sdpa_up_to: int, mita_up_to: int
) -> Callable[[int], dict[str, Callable]]:
    def table(length: int) -> dict[str, Callable]:
        ops: dict[str, Callable] = {}
        if length <= sdpa_up_to:
            ops["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if length <= mita_up_to:
            ops["mita"] = lambda q, k, v: mita_attention(
                q, k, v, landmarks=landmarks, topk=topk, causal=causal).out
        return ops
    return table


def bench_mita(
    lengths: list[int], *, landmarks: int = 64, topk: int = 64, repeats: int = 3, batch: int = 1,
    heads: int = 4, head_dim: int = 64, sdpa_up_to: int = 65536, causal_up_to: int = 65536,
    progress: Callable[[str], None] | None = None,
) -> list[OpsRow]:
    """Rows for both variants; impl names say which (e.g. "mita(m=64,k=64) causal")."""
    rows = []
    for causal in (False, True):
        table = mita_op_table(landmarks, topk, causal, sdpa_up_to,
                              causal_up_to if causal else max(lengths))
        suffix = "causal" if causal else "non-causal"
        for row in bench_ops(lengths, repeats=repeats, batch=batch, heads=heads, head_dim=head_dim,
                             ops=table, causal=causal, progress=progress):
            name = "sdpa" if row.impl == "sdpa" else f"mita(m={landmarks},k={topk})"
            rows.append(replace(row, impl=f"{name} {suffix}"))
    return rows


SCALING_HEADER = ("| impl | T | fwd µs/token | fwd+bwd µs/token | fwd peak KiB/token | "
                  "fwd+bwd peak KiB/token |\n|---|---|---|---|---|---|")


def scaling_rows(rows: list[OpsRow]) -> list[str]:
    """Per-token time and memory of the MiTA rows (flat in T = linear cost)."""
    def per_token(value: float | None, length: int, factor: float) -> str:
        return "n/a" if value is None or value != value else f"{value * factor / length:.2f}"

    return [
        f"| {row.impl} | {row.length} | {per_token(row.forward_ms, row.length, 1e3)} | "
        f"{per_token(row.forward_backward_ms, row.length, 1e3)} | "
        f"{per_token(row.forward_peak_mib, row.length, 1024)} | "
        f"{per_token(row.forward_backward_peak_mib, row.length, 1024)} |"
        for row in rows if row.impl.startswith("mita")
    ]


def bench_mita_forward(lengths: list[int], *, landmarks: int = 64, topk: int = 64, repeats: int = 5,
                       heads: int = 4, head_dim: int = 64, causal: bool = False,
                       progress: Callable[[str], None] | None = None) -> list[dict]:
    """Forward only (inference, no_grad), MiTA against SDPA at each length, alternating in one
    process: the long-sequence figure without SDPA's backward, which at N = 65536 takes minutes
    per call. Returns one record per length: medians (ms), speedup = SDPA / MiTA, MiTA's extra
    peak memory (MiB)."""
    import torch

    from routeformer.bench.ops_bench import forward_call
    from routeformer.bench.timing import median_times, peak_memory_mib

    table = mita_op_table(landmarks, topk, causal, max(lengths), max(lengths))
    records = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        inputs = tuple(torch.randn(1, heads, length, head_dim, generator=gen) for _ in range(3))
        ops = table(length)
        times = median_times({name: forward_call(op, inputs) for name, op in ops.items()}, repeats)
        record = {"length": length, "causal": causal, "sdpa_ms": times["sdpa"] * 1e3,
                  "mita_ms": times["mita"] * 1e3, "speedup": times["sdpa"] / times["mita"],
                  "mita_peak_mib": peak_memory_mib(forward_call(ops["mita"], inputs))}
        records.append(record)
        if progress:
            progress(format_forward_row(record))
    return records


FORWARD_HEADER = ("| N | variant | SDPA fwd ms | MiTA fwd ms | fwd speedup vs SDPA | MiTA fwd peak MiB |\n"
                  "|---|---|---|---|---|---|")


def format_forward_row(record: dict) -> str:
    variant = "causal" if record["causal"] else "non-causal"
    return (f"| {record['length']} | {variant} | {record['sdpa_ms']:.1f} | {record['mita_ms']:.1f} | "
            f"{record['speedup']:.1f}x | {record['mita_peak_mib']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    """`python -m routeformer.bench.mita_bench --lengths 65536 --repeats 5 [--output FILE]`:
    the forward-only table of `bench_mita_forward` (single-threaded unless --threads)."""
    import argparse
    import platform
    import time
    from pathlib import Path

    import torch

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    for name, value in (("lengths", min(args.lengths)), ("repeats", args.repeats), ("threads", args.threads)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1; got {value}")
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    print(FORWARD_HEADER, flush=True)
    try:
        records = bench_mita_forward(args.lengths, repeats=args.repeats, causal=args.causal,
                                     progress=lambda line: print(line, flush=True))
    finally:
        torch.set_num_threads(previous)
    if args.output:
        command = ("python -m routeformer.bench.mita_bench --lengths " + " ".join(map(str, args.lengths))
                   + f" --repeats {args.repeats} --threads {args.threads}"
                   + (" --causal" if args.causal else ""))
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        lines = [
            "# mita forward at long N (inference) against SDPA", "",
            f"Measured {when} on {platform.processor() or 'CPU'}, {args.threads} thread(s), "
            f"torch {torch.__version__}. Command: `{command}`. B = 1, H = 4, d = 64, fp32, "
            "m = k = 64, under no_grad; medians of alternating repetitions (one warm-up each); "
            "peak MiB = extra resident memory of one MiTA call.", "",
            FORWARD_HEADER, *map(format_forward_row, records), ""]
        Path(args.output).write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
