"""`routeformer reproduce structural-*`: "Attention as Implicit Structural Inference" (Singh & Buckley).

- structural-multihop (paper Figure 2): `structural_multihop`, seeded, lr chosen on validation.
- structural-recency (Figure 3, a recency task that needs attention): `structural_recency`.
- structural-expanding (Figure 3 as the paper states it): self-attention vs expanding attention
  across recency 1/p and feature dimension d, one seed. This task is solvable without attention
  (x2 = W_r x1 + e with a full-rank W_r: the last node alone gives y), so it shows nothing about
  attention; kept to regenerate its old report, which the docs no longer use as evidence.
- structural-expanding-long: the same task at T = 512 (same caveat).
- structural-lm: char-level LM on WikiText-2 text at T = 512, expanding vs full vs local, one seed.

The single-run helpers live in `structural_toys` (re-exported here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routeformer.experiments import (  # noqa: F401 (importing registers their experiments)
    structural_multihop,
    structural_recency,
    structural_speed,
    structural_update,
)
from routeformer.experiments.common import log, run_key, run_lm_variants
from routeformer.experiments.registry import register_experiment
from routeformer.experiments.report import cached_run, line_plot, markdown_table, provenance, write_result
from routeformer.experiments.structural_toys import (  # noqa: F401 (the public helpers of this family)
    EXPANDING_BLOCK,
    MULTIHOP_MODELS,
    RECENCY_TEST,
    TEST_SEQUENCES,
    chain_attention,
    run_multihop_model,
    run_recency_model,
    zero_prediction_mse,
)
from routeformer.tasks.structural import StructuralTask, recency_batch

# -- expanding --------------------------------------------------------------------------------------
EXPANDING_CONTEXT = 128


@register_experiment("structural-expanding", "Figure 3: self-attention vs expanding attention across "
                     "recency 1/p and feature dimension d")
def expanding(out_dir: Path, quick: bool) -> Path:
    recencies = [2.0, 32.0] if quick else [2.0, 8.0, 32.0]
    dims = [8, 64] if quick else [8, 32, 128]
    steps = 300 if quick else 600
    records = {}
    for dim in dims:
        for recency in recencies:
            task = StructuralTask(length=EXPANDING_CONTEXT, dim=dim, rank=dim, target_dim=4, noise=0.1,
                                  recency=recency)
            for mechanism in ("full", "expanding"):
                key = f"d{dim}-recency{int(recency)}-{mechanism}"
                log(f"structural-expanding: {key}")
                records[(dim, recency, mechanism)] = cached_run(
                    out_dir, key, lambda task=task, mechanism=mechanism:
                        run_recency_model(mechanism, task, steps, seed=0))
    rows, ratio_curves = [], {}
    for dim in dims:
        for recency in recencies:
            full, exp = records[(dim, recency, "full")], records[(dim, recency, "expanding")]
            ops_ratio = exp["final"]["flops_per_sequence"] / full["final"]["flops_per_sequence"]
            task = StructuralTask(length=EXPANDING_CONTEXT, dim=dim, rank=dim, target_dim=4, noise=0.1,
                                  recency=recency)
            rows.append([dim, recency, zero_prediction_mse(task, recency_batch, 0, RECENCY_TEST),
                         full["final"]["test_loss"], exp["final"]["test_loss"], ops_ratio,
                         exp["final"]["score_ops_vs_full"], exp["final"]["window_mean"],
                         exp["last_query"]["window_mean"], exp["last_query"]["iterations_mean"],
                         f"({exp['learned_prior']['alpha']:.2f}, {exp['learned_prior']['beta']:.2f})"])
            ratio_curves.setdefault(f"d={dim}", ([], []))
            ratio_curves[f"d={dim}"][0].append(recency)
            ratio_curves[f"d={dim}"][1].append(ops_ratio)
    line_plot(out_dir / "expanding_relative_ops.png", ratio_curves, xlabel="recency 1/p",
              ylabel="expanding FLOPs / self-attention FLOPs", title="relative operations (T=128)",
              logx=True)
    loss_curves = {}
    for (dim, recency, mechanism), record in records.items():
        if dim == dims[-1]:
            loss_curves[f"{mechanism} 1/p={recency:g}"] = (
                [e["step"] for e in record["history"]], [e["val_loss"] for e in record["history"]])
    line_plot(out_dir / "expanding_test_loss.png", loss_curves, xlabel="step", ylabel="validation MSE",
              title=f"recency task, d={dims[-1]}", logy=True)
    header = ["d", "recency 1/p", "predict-0 MSE", "self-attn test MSE", "expanding test MSE",
              "FLOPs vs self-attn",
              "scored pairs vs self-attn", "mean window (all queries)", "window of the last query",
              "iterations (last query)", "learned Beta(α, β)"]
    markdown = "\n\n".join([
        "# structural-expanding: recency task (paper Figure 3)",
        provenance(f"routeformer reproduce structural-expanding{' --quick' if quick else ''}"),
        f"Task: T={EXPANDING_CONTEXT}; x1 sits δ ~ Geometric(p) positions before x2 (the last node), "
        "x2 = W_r x1 + e, target y = W_y x1 read at x2; other nodes N(0, I). One single-head causal "
        f"layer (model dim = d), {steps} steps of batch 64, AdamW lr 3e-3, seed 0; test MSE on "
        f"{RECENCY_TEST} held-out sequences. expanding: block {EXPANDING_BLOCK}, Beta(1, 9) initial prior "
        "(starting window 44), tol 0.01, max 8 iterations. FLOPs are the executed attention FLOPs of "
        "the whole sequence (every query, inference steps included) from `stats['flops']`; scored "
        "pairs count q·k products at block granularity.",
        markdown_table(header, rows),
        "Paper's claim: test losses roughly equal; expanding needs relatively fewer operations when "
        "1/p is small relative to the context or d is large.",
        "Plots: `expanding_relative_ops.png`, `expanding_test_loss.png`.",
    ])
    result = {"context": EXPANDING_CONTEXT, "steps": steps,
              "rows": [dict(zip(header, row, strict=True)) for row in rows]}
    return write_result(out_dir, result, markdown)


LONG_CONTEXT = 512


@register_experiment("structural-expanding-long", "Figure 3's recency task at T=512, where the windows "
                     "are small against the context (d=128, 1/p = 2 and 32)")
def expanding_long(out_dir: Path, quick: bool) -> Path:
    """The T=128 grid cannot show the paper's relative-operations claim: its windows cover a third
    of the context. Here the same task runs at T=512 on two cells (short and long recency, d=128),
    300 steps, evaluated 3 times on 128 held-out sequences; quick: 60 steps."""
    steps, recencies, dim = (60 if quick else 300), [2.0, 32.0], 128
    rows = []
    for recency in recencies:
        task = StructuralTask(length=LONG_CONTEXT, dim=dim, rank=dim, target_dim=4, noise=0.1,
                              recency=recency)
        runs = {}
        for mechanism in ("full", "expanding"):
            key = run_key(f"T{LONG_CONTEXT}-d{dim}-recency{int(recency)}-{mechanism}")
            log(f"structural-expanding-long: {key}")
            runs[mechanism] = cached_run(
                out_dir, key, lambda task=task, mechanism=mechanism: run_recency_model(
                    mechanism, task, steps, seed=0, test_sequences=128, evals=3))
        full, exp = runs["full"]["final"], runs["expanding"]["final"]
        rows.append([dim, recency, zero_prediction_mse(task, recency_batch, 0, 128), full["test_loss"],
                     exp["test_loss"], exp["flops_per_sequence"] / full["flops_per_sequence"],
                     exp["score_ops_vs_full"], exp["window_mean"],
                     runs["expanding"]["last_query"]["window_mean"],
                     round(runs["full"]["train_seconds"]), round(runs["expanding"]["train_seconds"])])
    header = ["d", "recency 1/p", "predict-0 MSE", "self-attn test MSE", "expanding test MSE",
              "FLOPs vs self-attn", "scored pairs vs self-attn", "mean window (all queries)",
              "window of the last query", "self-attn train s", "expanding train s"]
    markdown = "\n\n".join([
        f"# structural-expanding-long: the recency task at T={LONG_CONTEXT}",
        provenance(f"routeformer reproduce structural-expanding-long{' --quick' if quick else ''}"),
        f"The task and models of structural-expanding at T={LONG_CONTEXT}: one single-head causal layer, "
        f"model dim = d, {steps} steps of batch 64, AdamW lr 3e-3, seed 0, test MSE on 128 held-out "
        "sequences; expanding with block 8 (the band path's block; the C kernels score per query), "
        "Beta(1, 9) initial prior. FLOPs are the executed attention FLOPs of whole sequences.",
        markdown_table(header, rows),
        "Paper's claim: expanding needs relatively fewer operations when 1/p is small relative to the "
        "context or d is large; test losses roughly equal.",
    ])
    result = {"context": LONG_CONTEXT, "steps": steps,
              "rows": [dict(zip(header, row, strict=True)) for row in rows]}
    return write_result(out_dir, result, markdown)


# -- language model ---------------------------------------------------------------------------------
LM_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "full": ("full", {}),
    "local(w=64)": ("local", {"window": 64}),
    "expanding": ("expanding", {}),
}


@register_experiment("structural-lm", "char-level LM on WikiText-2 text at T=512: expanding vs full vs local")
def lm(out_dir: Path, quick: bool) -> Path:
    steps = 60 if quick else 600
    corpus_name, records = run_lm_variants(
        out_dir, "structural-lm", LM_VARIANTS, steps,
        layer_stats={"expanding": ("window_mean", "window_max", "iterations_mean", "score_ops_vs_full")})
    full_flops = records["full"]["final"]["attention_flops_per_token"]
    rows = []
    for name, record in records.items():
        extra = record.get("layer_stats", {})
        rows.append([name, record["final"]["bpc"], record["final"]["attention_flops_per_token"] / full_flops,
                     extra.get("window_mean", "-"), extra.get("iterations_mean", "-"),
                     extra.get("score_ops_vs_full", "-"), round(record["train_seconds"], 1)])
    header = ["mechanism", "bits/char", "attention FLOPs vs full", "mean final window",
              "mean iterations", "scored pairs vs full", "train s"]
    markdown = "\n\n".join([
        "# structural-lm: character-level LM at T = 512",
        provenance(f"routeformer reproduce structural-lm{' --quick' if quick else ''}"),
        f"Corpus: {corpus_name}. Model: 2 layers, D=128, 4 heads, rotary positions; {steps} steps of "
        "batch 16 x 512, AdamW lr 3e-3, one seed. Bits per character on the whole evaluation split; "
        "attention FLOPs executed per token (full: the fused causal kernel's T(T+1)/2 pairs). "
        "expanding defaults: Beta(1, 9) initial prior, block 64, tol 0.01, max 8 iterations; its "
        "window and scored-pair figures are averaged over both layers on 4 validation sequences.",
        markdown_table(header, rows),
    ])
    result = {"corpus": corpus_name, "steps": steps,
              "rows": [dict(zip(header, row, strict=True)) for row in rows]}
    return write_result(out_dir, result, markdown)
