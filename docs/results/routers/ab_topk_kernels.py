"""A/B of topk's native kernels: the routing selection (route_topk_f32, tiled kernel, newest keys
first as the `topk` layer's recency router scans) and the routed attention forward and backward
(routed_attention_f32 and its backward), at git revision OLD against the working tree. Each side's
`src/routeformer/ops/native/` is copied whole (kernels and headers of that revision), its
topk_kernels.c compiled the same way (-O3 -march=native) into a throw-away library, and both are
called in one process on the same inputs, alternating order each round, one thread. Prints median
ms per call, the median per-round ratio new/old, and whether the two agree (same selected sets;
outputs and gradients within float32 rounding).

    python docs/results/routers/ab_topk_kernels.py [--old REV] [--batch 8] [--length 1024] \
        [--arch '-mavx2 -mfma']
"""

from __future__ import annotations

import argparse
import ctypes
import io
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
NATIVE = "src/routeformer/ops/native"
P = ctypes.c_void_p
I64 = ctypes.c_int64


def native_dir(revision: str | None, workdir: Path) -> Path:
    """The native folder at `revision` (None: the working tree) under workdir."""
    if revision is None:
        return ROOT / NATIVE
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, NATIVE], check=True,
                             capture_output=True).stdout
    target = workdir / revision
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target / NATIVE


def build(folder: Path, tag: str, workdir: Path, arch: list[str]) -> ctypes.CDLL:
    library = workdir / f"{tag}.so"
    subprocess.run(["cc", "-O3", *arch, "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
                    "-std=c11", f"-I{folder}", str(folder / "topk_kernels.c"), "-o", str(library), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(library))
    lib.routed_attention_f32.argtypes = [P] * 5 + [I64] * 9 + [ctypes.c_double, P, P, ctypes.c_int]
    lib.routed_attention_backward_f32.argtypes = ([P] * 8 + [I64] * 9 + [ctypes.c_double] + [P] * 3
                                                  + [ctypes.c_int])
    lib.route_topk_f32.argtypes = ([P] * 3 + [I64] * 7
                                   + [ctypes.c_int, I64, I64, ctypes.c_int, P, P, ctypes.c_int])
    lib.route_topk_f32.restype = I64
    return lib


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", default="f4d7546")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--arch", default="-march=native",
                        help="compiler flags choosing the instruction set of both sides, e.g. "
                             "'-mavx2 -mfma' for the AVX2 kernels on an AVX-512 machine")
    args = parser.parse_args()
    arch = args.arch.split()
    torch.set_num_threads(1)
    heads, dim, slots, length, batch, rdim = 2, 32, 64, args.length, args.batch, 17
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, heads, length, dim, generator=g) for _ in range(4))
    # routing vectors as the recency router makes them: 16 content dims and a position dim
    route_q = torch.cat([torch.randn(batch * heads, length, rdim - 1, generator=g),
                         torch.full((batch * heads, length, 1), 0.05)], -1).contiguous()
    positions = torch.arange(length, dtype=torch.float32).view(1, length, 1)
    positions = positions.expand(batch * heads, length, 1)
    route_k = torch.cat([torch.randn(batch * heads, length, rdim - 1, generator=g), positions], -1)
    tile = 16
    stride = -(-length // tile) * tile
    keys_t = torch.nn.functional.pad(route_k, (0, 0, 0, stride - length))
    keys_t = keys_t.unflatten(1, (stride // tile, tile))
    keys_t = keys_t.transpose(-1, -2).contiguous()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        libs = {"old": build(native_dir(args.old, work), "old", work, arch),
                "new": build(native_dir(None, work), "new", work, arch)}
        index = {n: torch.empty(batch * heads, length, slots, dtype=torch.long) for n in libs}
        valid = {n: torch.empty(batch * heads, length, slots, dtype=torch.uint8) for n in libs}
        out = {n: torch.empty(batch, heads, length, dim) for n in libs}
        lse = {n: torch.empty(batch, heads, length) for n in libs}
        grads = {n: [torch.zeros(batch, heads, length, dim) for _ in range(3)] for n in libs}
        scale = dim ** -0.5

        def route(name):
            libs[name].route_topk_f32(ptr(route_q), ptr(keys_t), None, batch * heads, heads, length,
                                      length, stride, rdim, slots, 1, 0, 0, 1, ptr(index[name]),
                                      ptr(valid[name]), 1)

        def forward(name):  # both sides attend over the new side's routing
            libs[name].routed_attention_f32(ptr(q), ptr(k), ptr(v), ptr(index["new"]), ptr(valid["new"]),
                                            batch, heads, length, length, dim, dim, slots,
                                            heads * length * slots, length * slots, scale, ptr(out[name]),
                                            ptr(lse[name]), 1)

        def backward(name):
            for grad in grads[name][1:]:
                grad.zero_()
            libs[name].routed_attention_backward_f32(
                ptr(q), ptr(k), ptr(v), ptr(index["new"]), ptr(valid["new"]), ptr(out["new"]),
                ptr(lse["new"]), ptr(dout), batch, heads, length, length, dim, dim, slots,
                heads * length * slots, length * slots, scale, *(ptr(t) for t in grads[name]), 1)

        route("new")
        forward("new")
        for name, call in (("route_topk", route), ("routed_attention forward", forward),
                           ("routed_attention backward", backward)):
            times = {"old": [], "new": []}
            for round_ in range(args.repeats + 1):
                for side in (("old", "new") if round_ % 2 else ("new", "old")):
                    began = time.perf_counter()
                    call(side)
                    if round_:
                        times[side].append(time.perf_counter() - began)
            ratio = statistics.median(n / o for n, o in zip(times["new"], times["old"], strict=True))
            print(f"{name}: old {1e3 * statistics.median(times['old']):.1f} ms, new "
                  f"{1e3 * statistics.median(times['new']):.1f} ms, new/old {ratio:.2f}")

        def member(name):
            counts = torch.zeros(batch * heads, length, length, dtype=torch.long)
            return counts.scatter_add_(-1, index[name], valid[name].long()) > 0

        print("same selected sets:", bool(torch.equal(member("old"), member("new"))))
        print(f"largest output difference: {float((out['old'] - out['new']).abs().max()):.2e}")
        print("largest gradient difference: " + ", ".join(
            f"{n} {float((a - b).abs().max()):.2e}"
            for n, a, b in zip("qkv", grads["old"], grads["new"], strict=True)))
    print(f"B={batch}, H={heads}, T={length}, d={dim}, K={slots}, routing dim {rdim}, one thread, "
          f"{args.repeats} alternating rounds, old {args.old}, compiled with {args.arch}")


if __name__ == "__main__":
    main()
