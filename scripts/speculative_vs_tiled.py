"""Time the speculative routing kernel (route_topk_rows_op) against the tiled one (route_topk_op,
route_topk_f32) on the same random routing vectors, alternating in one process; both select the same
keys (tests/ops/test_topk_speculative.py). Run at a forced level to time that build, e.g.

    ROUTEFORMER_ISA=avx2 python scripts/speculative_vs_tiled.py --length 16384

Prints each kernel's median time, the median of the per-round ratios (with their range) and how many
queries had their threshold guess refuted and were routed again."""

import argparse
import statistics
import time

import torch

from routeformer.ops.native import kernel, native_kernels
from routeformer.ops.native.topk import route_topk_op, route_topk_rows_op, speculative_query_tile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384, help="queries = keys (causal)")
    parser.add_argument("--rows", type=int, default=4, help="routing rows (heads)")
    parser.add_argument("--dim", type=int, default=16, help="routing dim")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if native_kernels(torch.zeros(1)) is None or not speculative_query_tile():
        raise SystemExit("this build has no speculative routing kernel (generic level, or no C compiler)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    shape = (1, args.rows, args.length, args.dim)
    queries, keys = torch.randn(shape), torch.randn(shape)
    tile = native_kernels(keys).route_topk_chunk()
    padded = -(-args.length // tile) * tile
    tiled_keys = torch.nn.functional.pad(keys, (0, 0, 0, padded - args.length))
    tiled_keys = tiled_keys.unflatten(2, (padded // tile, tile)).transpose(-1, -2).contiguous()
    refuted_before = int(kernel("route_topk_spec_refuted")())
    speculative, tiled = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        route_topk_rows_op(queries, keys, None, args.rows, args.topk, True, 0, 0)
        speculative.append(time.perf_counter() - start)
        start = time.perf_counter()
        route_topk_op(queries, tiled_keys, None, args.rows, args.length, args.topk, True, 0, 0)
        tiled.append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(speculative, tiled, strict=True)]
    refuted = int(kernel("route_topk_spec_refuted")()) - refuted_before
    fast, slow = statistics.median(speculative) * 1e3, statistics.median(tiled) * 1e3
    print(f"speculative {fast:.0f} ms, tiled {slow:.0f} ms "
          f"(medians of {args.rounds}); speculative / tiled {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}); refuted guesses {refuted} of "
          f"{args.rounds * args.rows * args.length} queries")


if __name__ == "__main__":
    main()
