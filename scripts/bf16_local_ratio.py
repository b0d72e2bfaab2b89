"""The bf16 / fp32 speed of the local (sliding-window) attention forward, in one process: the two
dtypes take turns on the same inputs (T = 16384, 4 heads, d = 64, w = 256, causal unless told
otherwise), and the ratio of their medians is printed (> 1: bf16 is faster). Run it before and after
a change to the local kernels, alternating, as in docs/results/ops-avx2.md:

    python scripts/bf16_local_ratio.py --rounds 8
"""

import argparse
import statistics
import time

import torch

from routeformer.ops import local_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    base = [torch.randn(1, args.heads, args.length, args.head_dim) for _ in range(3)]
    inputs = {dtype: [x.to(dtype) for x in base] for dtype in (torch.float32, torch.bfloat16)}
    times = {dtype: [] for dtype in inputs}
    with torch.no_grad():
        for round_ in range(args.rounds + 1):  # round 0 warms up (and builds the kernels)
            for dtype, (q, k, v) in inputs.items():
                start = time.perf_counter()
                local_attention(q, k, v, window=args.window, causal=True)
                if round_:
                    times[dtype].append(time.perf_counter() - start)
    fp32, bf16 = (statistics.median(times[dtype]) * 1e3 for dtype in inputs)
    print(f"local forward: fp32 {fp32:.1f} ms, bf16 {bf16:.1f} ms (medians of {args.rounds}); "
          f"bf16 speed / fp32 speed {fp32 / bf16:.2f}x")


if __name__ == "__main__":
    main()
