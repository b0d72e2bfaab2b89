"""`routeformer bench ops`: full, linear and local ops against scaled_dot_product_attention.

For each length T: forward (no autograd) and forward+backward medians, alternating the
implementations within each round, plus the extra peak memory of one call of each.
Ratios are speedups against SDPA measured in the same process: t_sdpa / t_impl.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from routeformer.bench.timing import machine_description, median_times, peak_memory_mib
from routeformer.ops import full_attention, linear_attention, local_attention


@dataclass
class OpsRow:
    length: int
    impl: str
    forward_ms: float
    forward_backward_ms: float
    forward_speedup: float
    forward_backward_speedup: float
    forward_peak_mib: float | None
    forward_backward_peak_mib: float | None


def op_table(window: int, causal: bool) -> dict[str, Callable]:
    return {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "full": lambda q, k, v: full_attention(q, k, v, causal=causal),
        "linear": lambda q, k, v: linear_attention(q, k, v, causal=causal),
        f"local(w={window})": lambda q, k, v: local_attention(q, k, v, window=window, causal=causal),
    }


def bench_ops(
    lengths: list[int], *, repeats: int = 5, window: int = 256, batch: int = 1, heads: int = 4,
    head_dim: int = 64, causal: bool = True, dtype: torch.dtype = torch.float32,
    device: str = "cpu", progress: Callable[[str], None] | None = None,
    ops: Callable[[int], dict[str, Callable]] | None = None, backward_up_to: int | None = None,
) -> list[OpsRow]:
    """Time every op of `ops(length)` (default: `op_table`) against the table's "sdpa" entry (NaN
    ratios where the table has none; an empty table skips the length). Lengths above
    `backward_up_to` are timed forward only (their backward columns are NaN)."""
    ops = ops or (lambda length: op_table(window, causal))
    rows = []
    for length in lengths:
        gen = torch.Generator(device=device).manual_seed(length)
        q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen, device=device, dtype=dtype)
                   for _ in range(3))
        grad_q, grad_k, grad_v = (t.clone().requires_grad_() for t in (q, k, v))
        table = ops(length)
        if not table:
            continue
        inputs, leaves = (q, k, v), (grad_q, grad_k, grad_v)
        with_backward = backward_up_to is None or length <= backward_up_to
        fwd = median_times({name: forward_call(op, inputs) for name, op in table.items()}, repeats)
        fwd_bwd = median_times(
            {name: forward_backward_call(op, leaves) for name, op in table.items()}, repeats
        ) if with_backward else dict.fromkeys(table, float("nan"))
        # A length where SDPA is too slow to time leaves it out of the table: ratios are NaN there.
        sdpa_fwd, sdpa_fwd_bwd = fwd.get("sdpa", float("nan")), fwd_bwd.get("sdpa", float("nan"))
        for name, op in table.items():
            row = OpsRow(
                length, name, fwd[name] * 1e3, fwd_bwd[name] * 1e3,
                sdpa_fwd / fwd[name], sdpa_fwd_bwd / fwd_bwd[name],
                peak_memory_mib(forward_call(op, inputs)),
                peak_memory_mib(forward_backward_call(op, leaves)) if with_backward else None,
            )
            rows.append(row)
            if progress:
                progress(format_row(row))
    return rows


def forward_call(op: Callable, inputs: tuple) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return op(*inputs)
    return run


def forward_backward_call(op: Callable, leaves: tuple) -> Callable[[], None]:
    def run():
        op(*leaves).sum().backward()
        for leaf in leaves:
            leaf.grad = None
    return run


def format_row(row: OpsRow) -> str:
    def mib(value):
        return "n/a" if value is None else f"{value:.1f}"

    return (f"| {row.length} | {row.impl} | {row.forward_ms:.1f} | {row.forward_speedup:.2f}x | "
            f"{row.forward_backward_ms:.1f} | {row.forward_backward_speedup:.2f}x | "
            f"{mib(row.forward_peak_mib)} | {mib(row.forward_backward_peak_mib)} |")


TABLE_HEADER = (
    "| T | impl | fwd ms | fwd speedup vs SDPA | fwd+bwd ms | fwd+bwd speedup vs SDPA | "
    "fwd peak MiB | fwd+bwd peak MiB |\n|---|---|---|---|---|---|---|---|"
)


def markdown_report(rows: list[OpsRow], settings: dict, title: str = "Ops benchmark") -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# {title}",
        "",
        f"Measured {now} on {machine_description()}.",
        f"Settings: {settings}. Medians of {settings.get('repeats')} alternating repetitions; "
        "speedup = SDPA time / impl time in the same process; peak MiB = extra resident memory "
        "of one call (inputs excluded).",
        "",
        TABLE_HEADER,
        *[format_row(row) for row in rows],
        "",
    ]
    return "\n".join(lines)


def rows_as_dicts(rows: list[OpsRow]) -> list[dict]:
    return [asdict(row) for row in rows]
