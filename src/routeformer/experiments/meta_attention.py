"""`routeformer reproduce meta-attention-*`: Meta-Attention, Bayesian per-token routing (issue: meta).

- meta-attention-init: the preprint's Table 2 (forward check at B=2, T=64, D=128, random weights).
- meta-attention-ablation: Table 3 — char-LM (D=128, 2 layers, T=64, batch 32, 2000 steps) on
  WikiText-2 (trained on valid.txt, evaluated on test.txt), Bayesian vs prior-free vs full
  attention, 3 seeds; KL and routing over training; evaluation under hard routing (perplexity and
  executed FLOPs); Table 4 from the measured routing; a routing map of a text sample.
- meta-attention-long: the falsifiability criterion — a char-LM trained at T=1024 and evaluated at
  T=4096, hard-routed meta vs full: executed attention FLOPs, forward wall clock, loss.
- meta-attention-matched (meta_attention_matched.py): the issue-27 redo on the shared `lm` task —
  one change per ablation, a parameter-matched `full`, 3 seeds, training length and 2x/4x apart.
  docs/results/meta.md quotes only it and meta-attention-init; the ablation and long results above
  were not re-run and are withdrawn as evidence (their "prior-free" removes both the prior offset
  and the KL term, and their `full` is not parameter-matched).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch

from routeformer.attention.meta import EXPERTS, MetaAttention
from routeformer.data.batches import sequential_batches
from routeformer.data.corpora import load_corpus
from routeformer.experiments.common import log, run_key, run_lm_variant
from routeformer.experiments.registry import register_experiment
from routeformer.experiments.report import (
    cached_run,
    line_plot,
    markdown_table,
    provenance,
    write_result,
)
from routeformer.models.transformer import init_weights
from routeformer.ops.dirichlet import dirichlet_kl, log_multivariate_beta
from routeformer.train.evaluate import evaluate_lm

PAPER_TABLE2 = {"weight_full": 0.209, "weight_linear": 0.406, "weight_local": 0.385,
                "mean_weight_entropy": 1.06, "kl": 3.42}
PAPER_TABLE3 = {
    "bayesian": {"normalised_ppl": 1.07, "routing_entropy_pct": 43.3, "projected_cost_pct": 25.1},
    "prior-free": {"normalised_ppl": 1.00, "routing_entropy_pct": 55.8, "projected_cost_pct": 59.3},
}
PAPER_TABLE4 = {"uniform": (0.33, 0.33, 0.33), "conservative": (0.50, 0.25, 0.25),
                "phase 1 empirical (est.)": (0.25, 0.50, 0.25), "optimistic": (0.20, 0.50, 0.30)}
COSTS = (1.0, 0.15, 0.30)
LOG_STATS = ("kl", "projected_cost", "routing_entropy_pct", "weight_full", "weight_linear", "weight_local",
             "hard_fraction")
ROUTING_STATS = ("weight_full", "weight_linear", "weight_local", "routing_entropy_pct", "projected_cost",
                 "kl", "uncertainty", "hard_fraction", "rows_full", "rows_linear", "rows_local",
                 "flops_vs_full")
HARD_ETAS = (0.0, 0.1, 0.25, 0.5)
ABLATION_WINDOW = 16  # the local expert's window at T = 64 (the preprint does not give one)


# -- init (Table 2) -----------------------------------------------------------------------------
@register_experiment("meta-attention-init", "Meta-Attention Table 2: forward check of the layer at init")
def run_init(out_dir: Path, quick: bool) -> Path:
    seeds = range(3 if quick else 10)
    records = []
    for seed in seeds:
        for init in ("pytorch-default", "gpt-0.02"):
            torch.manual_seed(seed)
            layer = MetaAttention(dim=128, heads=4, window=16).eval()
            if init == "gpt-0.02":  # what the routeformer Transformer applies to every Linear
                layer.apply(init_weights)
            x = torch.randn(2, 64, 128)
            with torch.no_grad():
                result = layer(x)
                concentration = layer.router(x, torch.arange(64).expand(2, 64))
            mean = concentration / concentration.sum(-1, keepdim=True)
            records.append({
                "seed": seed, "init": init, "output_shape": list(result.out.shape),
                "finite": bool(torch.isfinite(result.out).all()),
                "log_beta_prior": float(log_multivariate_beta(layer.router.prior)),
                "mean_sum_max_error": float((mean.sum(-1) - 1).abs().max()),
                **{key: float(result.stats[key]) for key in
                   ("weight_full", "weight_linear", "weight_local", "mean_weight_entropy", "kl",
                    "projected_cost", "uncertainty")},
            })
    prior = torch.tensor([0.01, 0.86, 0.71])
    delta = math.log(2.0)  # softplus(0): the increments when the controller's output is ~0
    analytic_mean = (prior + delta) / (prior + delta).sum()
    paper_full = PAPER_TABLE2["weight_full"]
    fitted_delta = (paper_full * float(prior.sum()) - 0.01) / (1 - 3 * paper_full)
    fitted_mean = (prior + fitted_delta) / (prior + fitted_delta).sum()

    def summary(init: str, key: str) -> str:
        values = [r[key] for r in records if r["init"] == init]
        return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"

    rows = [["output shape", "(2, 64, 128)", str(tuple(records[0]["output_shape"])), "same"],
            ["NaN / Inf", "none", "none" if all(r["finite"] for r in records) else "FOUND", "same"],
            ["log B(β) finite", "yes", f"{records[0]['log_beta_prior']:.3f}", "same"],
            ["posterior mean sum", "1.000 ± 0.000",
             f"max error {max(r['mean_sum_max_error'] for r in records):.1e}", "same"]]
    for key, label in (("weight_full", "mean weight E1 (full)"), ("weight_linear", "mean weight E2 (linear)"),
                       ("weight_local", "mean weight E3 (local)"),
                       ("mean_weight_entropy", "H[mean α] (nats)"), ("kl", "prior KL at init")):
        rows.append([label, f"≈ {PAPER_TABLE2[key]}", summary("pytorch-default", key),
                     summary("gpt-0.02", key)])
    markdown = "\n".join([
        "# Meta-Attention at initialisation (the preprint's Table 2)", "",
        provenance("routeformer reproduce meta-attention-init" + (" --quick" if quick else "")), "",
        f"B=2, T=64, D=128, 4 heads; mean ± std over {len(seeds)} seeds of the weights and the input.",
        "Columns: the preprint; ours with PyTorch's default Linear init (the preprint's \"random weights\");"
        " ours with the std-0.02 init routeformer's Transformer applies.", "",
        markdown_table(["metric", "paper", "ours (PyTorch init)", "ours (std 0.02 init)"], rows), "",
        "Where the numbers come from: β = [0.01, 0.86, 0.71] and δ = softplus(W₂ GELU(W₁ f) + b₂). "
        "With small weights the controller's output is ≈ 0, so δ ≈ softplus(0) = ln 2 for every expert and "
        f"the mean weights are (β + ln 2)/Σ(β + ln 2) = {_rounded(analytic_mean)} with KL "
        f"{float(dirichlet_kl(prior + delta, prior)):.2f}: the std-0.02 column. The preprint's numbers fit "
        f"a uniform δ ≈ {fitted_delta:.2f} instead (solving (0.01 + δ)/(1.58 + 3δ) = 0.209): that δ gives "
        f"weights {_rounded(fitted_mean)} and KL {float(dirichlet_kl(prior + fitted_delta, prior)):.2f}, "
        "matching all of their Table 2. So their controller's initial output was ≈ "
        f"{math.log(math.expm1(fitted_delta)):.2f} before the softplus (a positive bias or a wider hidden "
        "layer would do it), where ours is ≈ 0. The differences are that offset, not the formulas; we did "
        "not tune the initialisation to match.", ""])
    return write_result(out_dir, {"records": records, "paper": PAPER_TABLE2}, markdown)


# -- ablation (Table 3, hard routing, Table 4, routing map) -------------------------------------
def _rounded(values: torch.Tensor) -> list[float]:
    return [round(float(v), 3) for v in values]


def ablation_variants() -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        # position_scale=None: the preprint's position feature pos / (T - 1), as the paper trains it.
        "bayesian": ("meta", {"window": ABLATION_WINDOW, "position_scale": None}),
        "prior-free": ("meta", {"window": ABLATION_WINDOW, "prior": "none", "elbo_weight": 0.0,
                               "position_scale": None}),
        "full": ("full", {}),
    }


def meta_layers(model: torch.nn.Module) -> list[MetaAttention]:
    return [module for module in model.modules() if isinstance(module, MetaAttention)]


def routing_stats(model: torch.nn.Module, ids: torch.Tensor, seq_len: int, batch_size: int,
                  batches: int) -> dict[str, float]:
    """Meta layers' stats averaged over layers and `batches` evaluation batches."""
    sums: dict[str, list[float]] = {key: [] for key in ROUTING_STATS}
    with torch.no_grad():
        for index, (inputs, _) in enumerate(sequential_batches(ids, batch_size, seq_len)):
            if index == batches:
                break
            for layer_stats in model.backbone(inputs).stats:
                for key in ROUTING_STATS:
                    if key in layer_stats:
                        sums[key].append(float(layer_stats[key]))
    return {key: statistics.mean(values) for key, values in sums.items() if values}


def hard_evaluation(corpus: str, seq_len: int, batch_size: int, eval_tokens: int, etas=HARD_ETAS):
    """after_training hook: test loss and routing at soft routing and at each hard threshold."""
    def evaluate(result) -> dict[str, Any]:
        model = result.model.eval()
        ids = result.vocab.encode(load_corpus(corpus).val)
        layers = meta_layers(model)
        evaluations = []
        for eta in (None, *etas) if layers else (None,):
            for layer in layers:
                layer.eval_eta = eta
            metrics = evaluate_lm(model, ids, seq_len=seq_len, batch_size=batch_size, max_tokens=eval_tokens)
            record = {"eta": eta, **metrics}
            if layers:
                record["routing"] = routing_stats(model, ids, seq_len, batch_size, batches=8)
            evaluations.append(record)
        for layer in layers:
            layer.eval_eta = None
        return {"evaluations": evaluations}
    return evaluate


def ablation_run(out_dir: Path, name: str, seed: int, steps: int, eval_tokens: int) -> dict[str, Any]:
    """One cached (variant, seed) run of the ablation under out_dir (resumes if interrupted)."""
    mechanism, options = ablation_variants()[name]
    key = f"{run_key(name)}-seed{seed}"
    log(f"meta-attention-ablation: {key}")
    return cached_run(out_dir, key, lambda: run_lm_variant(
        out_dir / "train" / key, mechanism, options, steps, "wikitext2", seq_len=64, batch_size=32, seed=seed,
        log_stats=LOG_STATS if mechanism == "meta" else (),
        after_training=hard_evaluation("wikitext2", 64, 32, eval_tokens)))


def _ablation_runs(out_dir: Path, quick: bool) -> dict[str, list[dict[str, Any]]]:
    steps, seeds = (40, (0,)) if quick else (2000, (0, 1, 2))
    eval_tokens = 16384 if quick else 262144
    return {name: [ablation_run(out_dir, name, seed, steps, eval_tokens) for seed in seeds]
            for name in ablation_variants()}


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g}"


def _soft(run: dict[str, Any]) -> dict[str, Any]:
    return run["evaluations"][0]


@register_experiment("meta-attention-ablation",
                     "Meta-Attention Tables 3/4: Bayesian vs prior-free vs full char-LM, hard routing, "
                     "routing map")
def run_ablation(out_dir: Path, quick: bool) -> Path:
    runs = _ablation_runs(out_dir, quick)
    command = "routeformer reproduce meta-attention-ablation" + (" --quick" if quick else "")
    reference_ppl = [r["final"]["ppl"] for r in runs["prior-free"]]
    full_ppl = [r["final"]["ppl"] for r in runs["full"]]
    full_flops = statistics.mean(_soft(r)["attention_flops_per_token"] for r in runs["full"])

    table3 = []
    for name, records in runs.items():
        ppl = [r["final"]["ppl"] for r in records]
        row = [name, _mean_std([p / q for p, q in zip(ppl, reference_ppl, strict=True)]),
               _mean_std([p / q for p, q in zip(ppl, full_ppl, strict=True)]), _mean_std(ppl),
               _mean_std([r["final"]["bpc"] for r in records]),
               _mean_std([r["train_seconds"] / 60 for r in records])]
        if name == "full":
            row += ["—"] * 4
        else:
            routing = [_soft(r)["routing"] for r in records]
            row += [_mean_std([x["routing_entropy_pct"] for x in routing]),
                    _mean_std([100 * x["projected_cost"] for x in routing]),
                    _mean_std([x["kl"] for x in routing]),
                    _mean_std([r["history"][0]["attn_kl"] for r in records])]
        paper = PAPER_TABLE3.get(name)
        row.append("—" if paper is None else
                   f"PPL {paper['normalised_ppl']}, entropy {paper['routing_entropy_pct']}%, "
                   f"cost {paper['projected_cost_pct']}%")
        table3.append(row)

    hard_rows, table4_rows = [], []
    for name in ("bayesian", "prior-free"):
        records = runs[name]
        for index, evaluation in enumerate(records[0]["evaluations"]):
            per_seed = [r["evaluations"][index] for r in records]
            hard_rows.append([
                name, "soft" if evaluation["eta"] is None else evaluation["eta"],
                _mean_std([e["routing"]["hard_fraction"] for e in per_seed]),
                _mean_std([e["ppl"] for e in per_seed]),
                _mean_std([e["ppl"] / _soft(r)["ppl"] for e, r in zip(per_seed, records, strict=True)]),
                _mean_std([e["attention_flops_per_token"] / full_flops for e in per_seed]),
                _mean_std([e["routing"]["rows_full"] for e in per_seed])])
        all_hard = [next(e for e in r["evaluations"] if e["eta"] == 0.0)["routing"] for r in records]
        shares = [statistics.mean(x[f"rows_{expert}"] for x in all_hard) for expert in EXPERTS]
        table4_rows.append([f"measured: {name} (top-1 of ᾱ)", *[f"{100 * s:.1f}%" for s in shares],
                            f"{sum(s * c for s, c in zip(shares, COSTS, strict=True)):.3f}x",
                            f"{statistics.mean(_soft(r)['routing']['projected_cost'] for r in records):.3f}"])
    for scenario, shares in PAPER_TABLE4.items():
        table4_rows.append([f"paper: {scenario}", *[f"{100 * s:.0f}%" for s in shares],
                            f"{sum(s * c for s, c in zip(shares, COSTS, strict=True)):.3f}x", "—"])

    plots = []
    for stat, label in (("attn_kl", "KL[q ‖ prior] (mean over tokens, layers)"),
                        ("attn_projected_cost", "projected cost Σ ᾱ c"),
                        ("attn_routing_entropy_pct", "routing entropy (% of ln 3)")):
        series = {f"{name} seed {r['seed']}": ([h["step"] for h in r["history"]],
                                               [h[stat] for h in r["history"]])
                  for name in ("bayesian", "prior-free") for r in runs[name]}
        plot = line_plot(out_dir / f"{stat[5:]}.png", series, xlabel="step", ylabel=label,
                         title=f"meta: {label} over training")
        if plot:
            plots.append(plot.name)
    for name in ("bayesian", "prior-free"):
        map_path = routing_map(out_dir / "train" / f"{name}-seed0", out_dir / f"routing_map_{name}.png")
        if map_path:
            plots.append(map_path.name)

    first_kl = {name: [r["history"][0] for r in runs[name]] for name in ("bayesian", "prior-free")}
    steps = runs["full"][0]["steps"]
    markdown = "\n".join([
        "# Meta-Attention ablation: Bayesian vs prior-free vs full (the preprint's Tables 3 and 4)", "",
        provenance(command), "",
        f"Char-LM, D=128, 2 layers, 4 heads, T=64, batch 32, {steps} steps, lr 3e-3, rotary positions; "
        f"{load_corpus('wikitext2').name}; local window {ABLATION_WINDOW}; seeds "
        f"{[r['seed'] for r in runs['full']]} (mean ± std). Test perplexity is per character over the whole "
        "test split; routing statistics are on 8 test batches at evaluation (posterior mean, soft "
        "routing).", "",
        "## Table 3", "",
        markdown_table(["variant", "PPL / prior-free", "PPL / full", "test PPL", "test bpc", "train min",
                        "routing entropy %", "projected cost %", "KL at end", "KL at first log", "paper"],
                       table3), "",
        f"KL at the first log step (step {first_kl['bayesian'][0]['step']}) and at the end show whether the "
        "Bayesian controller collapses onto its prior (KL → 0, as the published code does within ~50 "
        "steps); plots: kl.png, projected_cost.png, routing_entropy_pct.png.", "",
        "## Hard routing at evaluation", "",
        "A token runs only its argmax expert when its certainty 1 − H(ᾱ)/ln 3 ≥ η (η = 0: every token "
        "hard). Perplexity on the first 262,144 test characters; attention FLOPs executed per token "
        "relative to the full-attention model's, measured on the same batches.", "",
        markdown_table(["variant", "η", "hard tokens", "test PPL", "PPL / soft",
                        "attention FLOPs / full model", "tokens running full"], hard_rows), "",
        "## Table 4: cost of top-1 hard routing", "",
        "C_hard = p₁c₁ + p₂c₂ + p₃c₃ with c = (1.0, 0.15, 0.30). Measured rows use the expert shares of our "
        "trained models at η = 0 (averaged over seeds); the last column is their soft projected cost Σ ᾱc.",
        "",
        markdown_table(["scenario", "p₁ full", "p₂ linear", "p₃ local", "C_hard", "soft Σ ᾱc"],
                       table4_rows), "",
        "The C_hard column is the preprint's normalised cost model. What hard routing really executes at "
        "T=64 is in the FLOPs column above (at this length the linear and local experts are not cheaper "
        "than full attention per token; see meta-attention-long and `routeformer bench meta` for long "
        "T).", "",
        "Routing maps: routing_map_bayesian.png and routing_map_prior-free.png colour each character of a "
        "test sample by its routing weights (red = full, green = linear, blue = local), layers 1 and 2 of "
        "the seed-0 models.", ""])
    result = {"runs": runs, "paper": {"table3": PAPER_TABLE3, "table4": PAPER_TABLE4}, "plots": plots}
    return write_result(out_dir, result, markdown)


def routing_map(run_dir: Path, path: Path, characters: int = 640, width: int = 80) -> Path | None:
    """A PNG: each character of a test sample on a background coloured (full, linear, local) = RGB."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from routeformer.train.checkpoint import load_trained_model

    if not (run_dir / "checkpoint.pt").exists():
        return None
    model, vocab, config = load_trained_model(run_dir)
    text = load_corpus(config.data.corpus).val[:characters]
    ids = vocab.encode(text)
    seq_len = config.data.seq_len
    weights_per_layer = []
    with torch.no_grad():
        for layer in meta_layers(model):
            captured = []
            handle = layer.router.register_forward_hook(
                lambda _module, _inputs, output, store=captured: store.append(output))
            model(ids[: len(ids) // seq_len * seq_len].view(-1, seq_len))
            handle.remove()
            concentration = captured[0].reshape(-1, len(EXPERTS))
            weights_per_layer.append(concentration / concentration.sum(-1, keepdim=True))
    rows = -(-min(len(text), len(weights_per_layer[0])) // width)
    panels = len(weights_per_layer)
    figure, _ = plt.subplots(panels, 1, figsize=(width * 0.16, rows * 0.3 * panels + 0.8))
    for index, (axis, weights) in enumerate(zip(list(figure.axes), weights_per_layer, strict=True)):
        for position, weight in enumerate(weights.tolist()):
            row, column = divmod(position, width)
            axis.add_patch(plt.Rectangle((column, -row - 1), 1, 1, color=weight, linewidth=0))
            character = text[position]
            axis.text(column + 0.5, -row - 0.5, "·" if character.isspace() else character, ha="center",
                      va="center", fontsize=6, family="monospace")
        axis.set_xlim(0, width)
        axis.set_ylim(-rows, 0)
        axis.axis("off")
        axis.set_title(f"layer {index + 1}: red = full, green = linear, blue = local (posterior mean ᾱ)",
                       fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return path


# -- long context (the falsifiability criterion) ------------------------------------------------
def _forward_seconds(
    models: dict[str, torch.nn.Module], inputs: dict[str, torch.Tensor], repeats: int
) -> dict[str, float]:
    """Median forward seconds per model on its `inputs`, alternating the models (one warm-up round)."""
    from routeformer.bench.ops_bench import forward_call
    from routeformer.bench.timing import median_times

    return median_times({name: forward_call(model, (inputs[name],)) for name, model in models.items()},
                        repeats)


@register_experiment("meta-attention-long",
                     "Meta-Attention falsifiability: train at T=1024, evaluate hard routing at T=4096")
def run_long(out_dir: Path, quick: bool) -> Path:
    train_len, eval_len, steps, batch = (128, 256, 30, 4) if quick else (1024, 4096, 300, 4)
    window = 32 if quick else 128
    hard_training = {"window": window, "train_eta": 0.0, "train_eta_start": 1.0, "eta_anneal_steps": steps,
                     "position_scale": float(train_len)}
    variants = {
        "full": ("full", {}),
        "meta bayesian (hard-trained)": ("meta", hard_training),
        "meta prior-free (hard-trained)": ("meta", {**hard_training, "prior": "none", "elbo_weight": 0.0}),
        # One Q/K/V projection for the three experts (the preprint's option): the separate experts'
        # K/V projections over every position are what the skipped attention has to pay for.
        "meta prior-free (hard-trained, shared qkv)": ("meta", {
            **hard_training, "prior": "none", "elbo_weight": 0.0, "share_qkv": True}),
    }
    runs = {}
    for name, (mechanism, options) in variants.items():
        key = run_key(name.replace(" ", "-"))
        log(f"meta-attention-long: {key}")
        runs[name] = cached_run(out_dir, key, lambda key=key, m=mechanism, o=options: run_lm_variant(
            out_dir / "train" / key, m, o, steps, "wikitext2", seq_len=train_len, batch_size=batch,
            log_stats=("hard_fraction", "projected_cost", "kl") if m == "meta" else ()))
    from routeformer.train.checkpoint import load_trained_model

    # Each model reads the text through its own vocabulary (runs trained by different versions can
    # differ, e.g. by the meta-token character).
    models, ids = {}, {}
    text = load_corpus("wikitext2").val
    for name in variants:
        models[name], vocab, _ = load_trained_model(out_dir / "train" / run_key(name.replace(" ", "-")))
        ids[name] = vocab.encode(text)
    eval_tokens = 4 * eval_len if quick else 16 * eval_len
    measured = {}
    settings = [("full", None)] + [(name, eta) for name in list(variants)[1:] for eta in (None, 0.25, 0.0)]
    for name, eta in settings:
        for layer in meta_layers(models[name]):
            layer.eval_eta = eta
        metrics = evaluate_lm(models[name], ids[name], seq_len=eval_len, batch_size=1, max_tokens=eval_tokens)
        routing = routing_stats(models[name], ids[name], eval_len, 1, batches=2) if name != "full" else {}
        measured[(name, eta)] = {**metrics, "routing": routing}
    for name in list(variants)[1:]:
        for layer in meta_layers(models[name]):
            layer.eval_eta = 0.0
    seconds = _forward_seconds(models, {name: ids[name][:eval_len].view(1, eval_len) for name in models},
                               repeats=3 if quick else 9)
    full = measured[("full", None)]
    rows = []
    for (name, eta), metrics in measured.items():
        flops_ratio = metrics["attention_flops_per_token"] / full["attention_flops_per_token"]
        rows.append([name, "soft" if (name != "full" and eta is None) else ("—" if eta is None else eta),
                     metrics["loss"], metrics["loss"] - full["loss"], flops_ratio,
                     metrics["routing"].get("hard_fraction", float("nan")),
                     metrics["routing"].get("rows_full", float("nan"))])
    criteria, verdicts = {}, []
    for name in list(variants)[1:]:
        hard = measured[(name, 0.0)]
        criteria[name] = {
            "flops_saving": 1 - hard["attention_flops_per_token"] / full["attention_flops_per_token"],
            "forward_time_saving": 1 - seconds[name] / seconds["full"],
            "loss_gap_nats": hard["loss"] - full["loss"],
        }
        met = criteria[name]["flops_saving"] >= 0.3 and criteria[name]["forward_time_saving"] >= 0.3 and \
            criteria[name]["loss_gap_nats"] <= 0.5
        criteria[name]["passed"] = met
        verdicts.append(
            f"- {name}, η = 0: FLOPs saving {100 * criteria[name]['flops_saving']:.0f}%, forward time saving "
            f"{100 * criteria[name]['forward_time_saving']:.0f}% ({1e3 * seconds[name]:.0f} ms vs "
            f"{1e3 * seconds['full']:.0f} ms), loss gap {criteria[name]['loss_gap_nats']:+.3f} nats → "
            f"**{'met' if met else 'not met'}**.")
    command = "routeformer reproduce meta-attention-long" + (" --quick" if quick else "")
    markdown = "\n".join([
        "# Meta-Attention at long context: the preprint's falsifiability criterion", "",
        provenance(command), "",
        f"Char-LM (D=128, 2 layers, 4 heads, rotary), trained at T={train_len}, batch {batch}, {steps} steps "
        f"on {load_corpus('wikitext2').name}. The meta models: local window {window}, trained with hard "
        "routing whose threshold η falls linearly from 1 (all soft) to 0 (all hard) over the run; router "
        f"position feature = position / {train_len}. Evaluated at T={eval_len} on {eval_tokens:,} test "
        "characters (batch 1).", "",
        markdown_table(["model", "η", "test loss (nats)", "Δ loss vs full", "attention FLOPs / full",
                        "hard tokens", "tokens running full"], rows), "",
        f"Forward wall clock at T={eval_len}, B=1: median of alternating repeats in one process, meta at "
        "η = 0.", "",
        "Criterion (≥ 30% fewer attention FLOPs, ≥ 30% faster forward, loss within 0.5 nats of full):", "",
        *verdicts, ""])
    result = {"runs": runs, "evaluations": {f"{name}@{eta}": m for (name, eta), m in measured.items()},
              "forward_seconds": seconds, "criteria": criteria}
    return write_result(out_dir, result, markdown)


# The issue-27 redo on the shared tasks lives in its own module; importing it here registers it.
from routeformer.experiments import meta_attention_matched  # noqa: E402, F401
