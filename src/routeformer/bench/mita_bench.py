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
