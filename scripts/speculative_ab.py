"""A/B two git revisions of a top-k kernel in one process: the speculative routing
(topk_speculative_kernels.c, the default) or, with `--op attention`, the fp32 routed-attention
forward (routed_attention_f32 in topk_kernels.c and the headers it includes).

Each revision's topk_kernels.c + topk_speculative_kernels.c (and the headers they include) is built
with the library's flags (-O3 -march=native -ffp-contract=fast -fopenmp) into its own shared
library; the two are loaded side by side and called alternately on the same random inputs
(causal, T = 16384, 4 rows, r = 16, K = 64, d = 64 unless told otherwise; the attention reads the
routing the first build selects), so the machine's drift falls on both. Prints each build's median
time, the median per-round ratio B / A with its range, and whether both gave the same result (the
same keys; for the attention, outputs equal within 1e-5). A revision `WORKTREE` is the working
tree's files. Run from the repository root, e.g.

    python scripts/speculative_ab.py 2733147~1 HEAD --threads 2
    python scripts/speculative_ab.py HEAD WORKTREE --op attention --threads 2
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

NATIVE = "src/routeformer/ops/native"
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def build(revision: str, into: Path) -> ctypes.CDLL:
    """Check out the native sources of `revision` into `into` and build the two routing files."""
    into.mkdir()
    if revision == "WORKTREE":
        names = [path.name for path in Path(NATIVE).iterdir()]
    else:
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{NATIVE}"], check=True,
                               capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            if revision == "WORKTREE":
                text = (Path(NATIVE) / name).read_bytes()
            else:
                text = subprocess.run(["git", "show", f"{revision}:{NATIVE}/{name}"], check=True,
                                      capture_output=True).stdout
            (into / name).write_bytes(text)
    library = into / "routing.so"
    subprocess.run(["cc", *FLAGS, str(into / "topk_kernels.c"), str(into / "topk_speculative_kernels.c"),
                    "-o", str(library), "-lm"], check=True)
    loaded = ctypes.CDLL(str(library))
    loaded.route_topk_spec.restype = ctypes.c_int64
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    loaded.route_topk_spec.argtypes = ([pointer, pointer, ctypes.c_int, pointer] + [int64] * 6
                                       + [ctypes.c_int, int64, int64, pointer, pointer, ctypes.c_int])
    loaded.routed_attention_backward_f32.restype = None
    loaded.routed_attention_backward_f32.argtypes = ([pointer] * 8 + [int64] * 9 + [ctypes.c_double]
                                                     + [pointer] * 3 + [ctypes.c_int])
    loaded.routed_attention_f32.restype = None
    loaded.routed_attention_f32.argtypes = ([pointer] * 5 + [int64] * 9 + [ctypes.c_double, pointer, pointer,
                                                                           ctypes.c_int])
    return loaded


def attention_round(library: ctypes.CDLL, inputs: tuple, rows: int, length: int, slots: int,
                    threads: int) -> torch.Tensor:
    """One fp32 routed-attention forward over `rows` heads; returns its output."""
    q, k, v, index, valid = inputs
    out, lse = torch.empty_like(q), torch.empty(rows, length)
    dim = q.shape[-1]
    library.routed_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(), valid.data_ptr(),
                                 1, rows, length, length, dim, dim, slots, rows * length * slots,
                                 length * slots, dim ** -0.5, out.data_ptr(), lse.data_ptr(), threads)
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Routing: the same keys; attention: outputs within 1e-5 (the summation order may differ)."""
    if a.dtype == torch.long:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def backward_round(library: ctypes.CDLL, inputs: tuple, forward: tuple, rows: int, length: int, slots: int,
                   threads: int) -> torch.Tensor:
    """One fp32 routed-attention backward over `rows` heads (from the forward's out and lse);
    returns the gradients, concatenated."""
    q, k, v, index, valid = inputs
    out, lse, grad_out = forward
    grads = [torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    dim = q.shape[-1]
    library.routed_attention_backward_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(), valid.data_ptr(), out.data_ptr(),
        lse.data_ptr(), grad_out.data_ptr(), 1, rows, length, length, dim, dim, slots, rows * length * slots,
        length * slots, dim ** -0.5, *(g.data_ptr() for g in grads), threads)
    return torch.cat([g.flatten() for g in grads])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="git revision A (e.g. the build before a change)")
    parser.add_argument("b", help="git revision B")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--op", choices=("routing", "attention", "backward"), default="routing")
    parser.add_argument("--head-dim", type=int, default=64, help="attention: q, k, v width")
    parser.add_argument("--data", choices=("random", "refuting"), default="random",
                        help="routing vectors: standard normal, or keys twice as spread along dim 0 and "
                        "queries with dim 0 zeroed in every other run of 40 (the K-th best / |q| jumps "
                        "between blocks, so some guesses are refuted and those queries routed again)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        libraries = [build(revision, Path(scratch) / name)
                     for name, revision in (("a", args.a), ("b", args.b))]
        torch.manual_seed(0)
        rows, length, dim, slots = args.rows, args.length, args.dim, args.topk
        queries, keys = torch.randn(rows, length, dim), torch.randn(rows, length, dim)
        if args.data == "refuting":
            keys[..., 0] *= 2.0
            queries[:, (torch.arange(length) // 40) % 2 == 1, 0] = 0.0
        times, selections = [[], []], []
        if args.op in ("attention", "backward"):
            index = torch.empty(rows, length, slots, dtype=torch.long)
            valid = torch.empty(rows, length, slots, dtype=torch.uint8)
            libraries[0].route_topk_spec(queries.data_ptr(), keys.data_ptr(), 0, None, rows, rows, length,
                                         length, dim, slots, 1, 0, 0, index.data_ptr(), valid.data_ptr(),
                                         args.threads)
            inputs = (*(torch.randn(rows, length, args.head_dim) for _ in range(3)), index, valid)
            if args.op == "backward":  # the same forward outputs for both builds
                out = attention_round(libraries[0], inputs, rows, length, slots, args.threads)
                lse = torch.empty(rows, length)
                q, k, v = inputs[:3]
                libraries[0].routed_attention_f32(
                    q.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(), valid.data_ptr(), 1, rows,
                    length, length, q.shape[-1], q.shape[-1], slots, rows * length * slots, length * slots,
                    q.shape[-1] ** -0.5, out.data_ptr(), lse.data_ptr(), args.threads)
                forward = (out, lse, torch.randn_like(out))
        for round_ in range(args.rounds):
            for n, library in enumerate(libraries):
                if args.op in ("attention", "backward"):
                    start = time.perf_counter()
                    out = (attention_round(library, inputs, rows, length, slots, args.threads)
                           if args.op == "attention"
                           else backward_round(library, inputs, forward, rows, length, slots, args.threads))
                    times[n].append(time.perf_counter() - start)
                    if round_ == 0:
                        selections.append(out)
                    continue
                index = torch.empty(rows, length, slots, dtype=torch.long)
                valid = torch.empty(rows, length, slots, dtype=torch.uint8)
                start = time.perf_counter()
                done = library.route_topk_spec(
                    queries.data_ptr(), keys.data_ptr(), 0, None, rows, rows, length, length, dim, slots,
                    1, 0, 0, index.data_ptr(), valid.data_ptr(), args.threads)
                times[n].append(time.perf_counter() - start)
                if done < 0:
                    raise SystemExit(f"revision {(args.a, args.b)[n]}: this build has no speculative kernel")
                if round_ == 0:
                    chosen = torch.where(valid.bool(), index, -1).sort(dim=-1).values
                    selections.append(chosen)
    ratios = [b / a for a, b in zip(*times, strict=True)]
    a_ms, b_ms = (statistics.median(t) * 1e3 for t in times)
    print(f"A {args.a}: {a_ms:.0f} ms, B {args.b}: {b_ms:.0f} ms (medians of {args.rounds}, {args.threads} "
          f"thread(s)); B / A {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}); "
          f"same result: {same(*selections)}")


if __name__ == "__main__":
    main()
