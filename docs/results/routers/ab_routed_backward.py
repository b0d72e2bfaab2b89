"""A/B of topk's native routed-attention backward: the kernel at git revision OLD (default 37e21f9,
before the three-pass rewrite) against the working tree's, compiled the same way (-O3
-march=native) into two throw-away libraries and called in the same process on the same inputs,
alternating order each round (one thread). Prints median ms per call, the median per-round ratio
and the largest difference of the gradients (the rewrite keeps the accumulation order).

    python docs/results/routers/ab_routed_backward.py [--old REV] [--batch 8] [--length 1024]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from routeformer.ops.topk import routed_attention

ROOT = Path(__file__).resolve().parents[3]
KERNEL = "src/routeformer/ops/native/topk_kernels.c"
NATIVE_DIR = ROOT / "src/routeformer/ops/native"


def build(source: str, tag: str, workdir: Path) -> ctypes.CDLL:
    renamed = source.replace("routed_attention_backward_f32", f"{tag}_backward_f32")
    renamed = renamed.replace("routed_attention_backward_f64", f"{tag}_backward_f64")
    path = workdir / f"{tag}.c"
    path.write_text(renamed)
    library = workdir / f"{tag}.so"
    subprocess.run(["cc", "-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
                    "-std=c11", f"-I{NATIVE_DIR}", str(path), "-o", str(library), "-lm"], check=True)
    return ctypes.CDLL(str(library))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", default="37e21f9")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    heads, dim, slots, length, batch = 2, 32, 64, args.length, args.batch
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.old}:{KERNEL}"], check=True,
                         capture_output=True, text=True).stdout
    new = (ROOT / KERNEL).read_text()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator) for _ in range(3))
    # half recent keys, half spread: a causal routing with a recency preference
    distance = (torch.arange(length)[None, :] - torch.arange(length)[:, None]).clamp(max=0).float()
    scores = torch.rand(batch, heads, length, length, generator=generator) + distance / 64
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), -1e9)
    index = scores.topk(slots, -1).indices.contiguous()
    valid = (torch.gather(scores, -1, index) > -1e8).contiguous()
    out, lse = routed_attention(q, k, v, index, valid)
    lse = lse.float().contiguous()
    grad_out = torch.randn(out.shape, generator=generator)
    pointer = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    with tempfile.TemporaryDirectory() as workdir:
        libraries = {"old": build(old, "old", Path(workdir)), "new": build(new, "new", Path(workdir))}
        grads, times = {}, {"old": [], "new": []}

        def run(tag: str) -> None:
            grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            getattr(libraries[tag], f"{tag}_backward_f32")(
                pointer(q), pointer(k), pointer(v), pointer(index), pointer(valid.view(torch.uint8)),
                pointer(out), pointer(lse), pointer(grad_out), *map(ctypes.c_int64, (
                    batch, heads, length, length, dim, dim, slots, heads * length * slots, length * slots)),
                ctypes.c_double(dim ** -0.5), pointer(grad_q), pointer(grad_k), pointer(grad_v),
                ctypes.c_int(1))
            grads[tag] = (grad_q, grad_k, grad_v)

        for round_index in range(args.repeats + 1):
            for tag in ("old", "new") if round_index % 2 == 0 else ("new", "old"):
                start = time.perf_counter()
                run(tag)
                if round_index:
                    times[tag].append(time.perf_counter() - start)
    ratio = statistics.median(a / b for a, b in zip(times["new"], times["old"], strict=True))
    difference = max(float((a - b).abs().max()) for a, b in zip(grads["old"], grads["new"], strict=True))
    print(f"B={batch} H={heads} T={length} d={dim} K={slots}, one thread, {args.repeats} rounds")
    print(f"old ({args.old}) {1000 * statistics.median(times['old']):.1f} ms, "
          f"new {1000 * statistics.median(times['new']):.1f} ms, new/old {ratio:.2f}, "
          f"largest gradient difference {difference:.2e}")


if __name__ == "__main__":
    main()
