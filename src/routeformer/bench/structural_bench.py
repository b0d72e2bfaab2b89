"""`routeformer bench structural`: the multihop and expanding ops against SDPA.

multihop runs two hops (P V + P (P V)). expanding's cost depends on the windows its inference
settles on, so it is timed at two priors — Beta(1, 9) (starting window 44) and Beta(1, 99)
(starting window 459) — on random q, k, v, and `expanding_windows` reports the mean final window
each one reached at every length. Causal, fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from routeformer.ops import expanding_attention, multihop_attention

EXPANDING_PRIORS = {"expanding(Beta(1,9))": (1.0, 9.0), "expanding(Beta(1,99))": (1.0, 99.0)}


def _prior(heads: int, alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((heads,), alpha), torch.full((heads,), beta)


def structural_op_table(heads: int) -> Callable[[int], dict[str, Callable]]:
    def table(length: int) -> dict[str, Callable]:
        ops = {
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "multihop(hops=2)": lambda q, k, v: multihop_attention(q, k, v, hops=2, causal=True),
        }
        for name, (alpha, beta) in EXPANDING_PRIORS.items():
            prior = _prior(heads, alpha, beta)
            ops[name] = lambda q, k, v, prior=prior: expanding_attention(q, k, v, *prior).out
        return ops
    return table


def expanding_windows(
    lengths: list[int], *, batch: int = 1, heads: int = 4, head_dim: int = 64
) -> list[dict]:
    """Mean/max final window, mean iterations and scored pairs vs causal SDPA's, per prior and length,
    on the same random inputs `bench_ops` draws (seeded by the length)."""
    records = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen) for _ in range(3))
        for name, (alpha, beta) in EXPANDING_PRIORS.items():
            with torch.no_grad():
                result = expanding_attention(q, k, v, *_prior(heads, alpha, beta))
            window = result.horizon.float()
            records.append({
                "length": length, "impl": name, "window_mean": float(window.mean()),
                "window_max": float(window.max()), "window_mean_over_T": float(window.mean()) / length,
                "iterations_mean": float(result.iterations.float().mean()),
                "score_pairs_vs_full": result.scored_pairs / (batch * heads * length * (length + 1) / 2),
            })
    return records


WINDOW_HEADER = ("| T | impl | mean window | max window | mean window / T | mean iterations | "
                 "scored pairs vs causal SDPA |\n|---|---|---|---|---|---|---|")


def format_window_row(record: dict) -> str:
    return (f"| {record['length']} | {record['impl']} | {record['window_mean']:.1f} | "
            f"{record['window_max']:.0f} | {record['window_mean_over_T']:.4f} | "
            f"{record['iterations_mean']:.2f} | {record['score_pairs_vs_full']:.4f} |")
