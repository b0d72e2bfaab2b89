"""MiTA experiments (issue 4): `routeformer reproduce mita-{digits-vit,budget,listops,lm,speed}`.

- mita-digits-vit: a small ViT on scikit-learn's 8×8 digits (64 patches + CLS) and upsampled to
  16×16 (256 + CLS): full, linear, agent, route-only and MiTA at equal budget, 3 seeds.
- mita-budget: MiTA trained at m = k = 16 (16×16 digits), evaluated at other m and k; and
  mechanisms swapped at inference (MiTA-trained -> full attention, full-trained -> MiTA).
- mita-listops: ListOps from our generator (LRA's grammar), full / linear / local / MiTA.
- mita-lm: the causal variant in a char-level LM (ours; the paper has none).
- mita-speed: `bench_mita` (non-causal and causal MiTA vs SDPA up to N = 262144).
Every training run is cached under out_dir/runs (a killed experiment resumes after its finished
runs); the budget experiment also keeps its trained weights under out_dir/models.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from routeformer.data.digits import NUM_CLASSES, ImageSplit, load_digits
from routeformer.experiments.common import lm_comparison, log, run_key
from routeformer.experiments.registry import register_experiment
from routeformer.experiments.report import cached_run, line_plot, markdown_table, provenance, write_result
from routeformer.models.config import ModelConfig
from routeformer.models.vit import VisionConfig, ViT
from routeformer.train.task_loop import TaskTrainConfig, train_task

VIT_SHAPE = {"dim": 64, "depth": 2, "heads": 4, "mlp_ratio": 2.0}
PAPER_LISTOPS = {"full": 37.10, "mita": 37.20}  # LRA ListOps accuracy (%), MiTA paper Table 5


def vit_variants() -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "full": ("full", {}),
        "linear": ("linear", {}),
        "agent(m=16)": ("mita", {"preset": "agent", "landmarks": 16}),
        "route-only(m=k=16)": ("mita", {"preset": "route_only", "landmarks": 16, "topk": 16}),
        "mita(m=k=8)": ("mita", {"landmarks": 8, "topk": 8}),
        "mita(m=k=16)": ("mita", {"landmarks": 16, "topk": 16}),
    }


def build_vit(mechanism: str, options: dict[str, Any], size: int) -> ViT:
    config = ModelConfig(**VIT_SHAPE, attention=mechanism, causal=False, num_classes=NUM_CLASSES,
                         attention_options={mechanism: dict(options)} if options else {})
    return ViT(config, VisionConfig(image_size=size, patch_size=1, channels=1))


@torch.no_grad()
def vit_accuracy(model: ViT, split: ImageSplit, batch_size: int = 256) -> dict[str, float]:
    """Test accuracy and the executed attention FLOPs per image (all layers)."""
    model.eval()
    correct, flops = 0, 0.0
    for start in range(0, len(split.labels), batch_size):
        images = split.images[start:start + batch_size]
        output = model(images)
        correct += int((output.logits.argmax(-1) == split.labels[start:start + batch_size]).sum())
        flops += sum(float(layer["flops"]) for layer in output.stats)
    return {"accuracy": correct / len(split.labels), "attention_flops_per_image": flops / len(split.labels)}


def train_vit(mechanism: str, options: dict[str, Any], size: int, seed: int, steps: int) -> tuple[ViT, dict]:
    train_split, test_split = load_digits(size)
    torch.manual_seed(seed)
    model = build_vit(mechanism, options, size)

    def make_batch(batch_size: int, generator: torch.Generator):
        index = torch.randint(len(train_split.labels), (batch_size,), generator=generator)
        return train_split.images[index], train_split.labels[index]

    config = TaskTrainConfig(steps=steps, batch_size=64, lr=2e-3, warmup_steps=steps // 10,
                             weight_decay=0.05, eval_every=max(1, steps // 4), seed=seed)
    history = train_task(model, make_batch, lambda m: vit_accuracy(m, test_split), config,
                         log=lambda line: log(f"  {line}"))
    record = {"mechanism": mechanism, "options": options, "size": size, "seed": seed, "steps": steps,
              "train_seconds": history.train_seconds, "history": history.evals, **history.final}
    return model, record


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


@register_experiment("mita-digits-vit", "ViT on 8x8 / 16x16 digits: full, linear, agent, route-only, "
                     "MiTA; accuracy and attention FLOPs, 3 seeds")
def digits_vit(out_dir: Path, quick: bool) -> Path:
    sizes = [8] if quick else [8, 16]
    seeds = [0] if quick else [0, 1, 2]
    steps = {8: 150 if quick else 600, 16: 250}
    records: dict[tuple[int, str], list[dict]] = {}
    for size in sizes:
        for name, (mechanism, options) in vit_variants().items():
            for seed in seeds:
                key = run_key(f"S{size}-{name}-seed{seed}")
                log(f"mita-digits-vit: {key}")
                record = cached_run(out_dir, key, lambda m=mechanism, o=options, s=size, sd=seed:
                                    train_vit(m, o, s, sd, steps[s])[1])
                records.setdefault((size, name), []).append(record)
    rows = []
    for (size, name), runs in records.items():
        accuracy, spread = _mean_std([100 * run["accuracy"] for run in runs])
        flops = runs[0]["attention_flops_per_image"]
        full_flops = records[(size, "full")][0]["attention_flops_per_image"]
        seconds = statistics.mean(run["train_seconds"] for run in runs)
        rows.append([f"{size}x{size} ({size * size}+1)", name, f"{accuracy:.2f} ± {spread:.2f}",
                     f"{flops / 1e6:.3f}", f"{flops / full_flops:.3f}", round(seconds, 1)])
    for size in sizes:  # one point per mechanism: accuracy against executed FLOPs
        line_plot(out_dir / f"accuracy_vs_flops_{size}.png",
                  {name: ([records[(size, name)][0]["attention_flops_per_image"] / 1e6],
                          [100 * statistics.mean(r["accuracy"] for r in records[(size, name)])])
                   for name in vit_variants()},
                  xlabel="executed attention MFLOPs per image", ylabel="test accuracy (%)",
                  title=f"digits {size}x{size}: accuracy vs attention FLOPs", logx=True)
    shape = ", ".join(f"{k}={v}" for k, v in VIT_SHAPE.items())
    markdown = "\n\n".join([
        "# mita-digits-vit: a small ViT on scikit-learn's digits",
        provenance(f"routeformer reproduce mita-digits-vit{' --quick' if quick else ''}"),
        f"ViT ({shape}), patch size 1, CLS token, learned positions; 1438 train / 359 test images "
        f"(seeded split); AdamW lr 2e-3, batch 64, {steps} steps per size; seeds {seeds} "
        "(mean ± std). Attention FLOPs: executed, all layers, per image (`stats['flops']`). "
        "agent = MiTA with k = 0; route-only = MiTA without the shared expert.",
        markdown_table(["image (tokens)", "mechanism", "test accuracy %", "attention MFLOPs/image",
                        "vs full", "train s"], rows),
        "The paper has no digits result; its claim is that MiTA matches full attention at lower "
        "cost on vision tasks (ImageNet, segmentation), which this table tests at toy scale.",
        "Plots: " + ", ".join(f"`accuracy_vs_flops_{size}.png`" for size in sizes) + ".",
    ])
    result = {"rows": [dict(zip(["image", "mechanism", "accuracy", "attention_mflops_per_image",
                                 "flops_vs_full", "train_seconds"], row, strict=True)) for row in rows],
              "runs": {f"{size}-{name}": runs for (size, name), runs in records.items()}}
    return write_result(out_dir, result, markdown)


BUDGETS = [4, 8, 16, 32, 64]


def _budget_record(out_dir: Path, seed: int, steps: int) -> dict[str, Any]:
    """Train MiTA (m = k = 16) and full on 16×16 digits; evaluate at other budgets and swapped."""
    _, test_split = load_digits(16)
    models_dir = out_dir / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    trained = {}
    for name, (mechanism, options) in {"mita": ("mita", {"landmarks": 16, "topk": 16}),
                                       "full": ("full", {})}.items():
        path = models_dir / f"{name}-seed{seed}.pt"
        model = build_vit(mechanism, options, 16)
        if path.exists():
            model.load_state_dict(torch.load(path))
        else:
            log(f"mita-budget: training {name} seed {seed}")
            model, _ = train_vit(mechanism, options, 16, seed, steps)
            torch.save(model.state_dict(), path)
        trained[name] = model
    record: dict[str, Any] = {"seed": seed, "vary_m": {}, "vary_k": {}}
    for budget in BUDGETS:
        for axis, setting in (("vary_m", {"landmarks": budget}), ("vary_k", {"topk": budget})):
            for block in trained["mita"].backbone.blocks:
                block.attention.set_budget(landmarks=16, topk=16)
                block.attention.set_budget(**setting)
            record[axis][str(budget)] = vit_accuracy(trained["mita"], test_split)  # JSON keys
    for block in trained["mita"].backbone.blocks:
        block.attention.set_budget(landmarks=16, topk=16)
    record["mita_trained"] = {"mita": vit_accuracy(trained["mita"], test_split)}
    record["full_trained"] = {"full": vit_accuracy(trained["full"], test_split)}
    # Swap: the attention layers share their projections' names, so the weights load as they are.
    as_full = build_vit("full", {}, 16)
    as_full.load_state_dict(trained["mita"].state_dict())
    record["mita_trained"]["full"] = vit_accuracy(as_full, test_split)
    for budget in (16, 64):
        as_mita = build_vit("mita", {"landmarks": budget, "topk": budget}, 16)
        as_mita.load_state_dict(trained["full"].state_dict())
        record["full_trained"][f"mita(m=k={budget})"] = vit_accuracy(as_mita, test_split)
    return record


@register_experiment("mita-budget", "MiTA trained at m=k=16, evaluated at m, k in 4..64; mechanisms "
                     "swapped at inference (paper Figs. 7-8)")
def budget(out_dir: Path, quick: bool) -> Path:
    seeds = [0] if quick else [0, 1, 2]
    steps = 150 if quick else 400
    records = [cached_run(out_dir, f"seed{seed}", lambda seed=seed: _budget_record(out_dir, seed, steps))
               for seed in seeds]

    def accuracy(getter) -> str:
        mean, spread = _mean_std([100 * getter(record)["accuracy"] for record in records])
        return f"{mean:.2f} ± {spread:.2f}"

    budget_rows = [[budget, accuracy(lambda r, b=budget: r["vary_m"][str(b)]),
                    accuracy(lambda r, b=budget: r["vary_k"][str(b)])] for budget in BUDGETS]
    swap_rows = []
    for trained, evaluations in (("mita(m=k=16)", "mita_trained"), ("full", "full_trained")):
        for evaluated in records[0][evaluations]:
            swap_rows.append([trained, evaluated, accuracy(lambda r, e=evaluations, v=evaluated: r[e][v])])

    def curve(axis: str) -> tuple[list[int], list[float]]:
        values = [statistics.mean(100 * r[axis][str(b)]["accuracy"] for r in records) for b in BUDGETS]
        return BUDGETS, values

    line_plot(out_dir / "budget.png", {"vary m (k=16)": curve("vary_m"), "vary k (m=16)": curve("vary_k")},
              xlabel="m or k at evaluation", ylabel="test accuracy (%)",
              title="MiTA trained at m=k=16 (16x16 digits)", logx=True)
    markdown = "\n\n".join([
        "# mita-budget: changing m and k at inference, and swapping mechanisms",
        provenance(f"routeformer reproduce mita-budget{' --quick' if quick else ''}"),
        f"ViT as in mita-digits-vit on 16×16 digits (256 patches + CLS), trained {steps} steps with "
        f"MiTA m = k = 16 (and with full attention for the swap); seeds {seeds} (mean ± std). The "
        "paper (Fig. 7) finds MiTA more robust to increasing m, k at inference than to decreasing "
        "them, and (Fig. 8) that weights trained with one mechanism transfer to the other.",
        "## Budget at evaluation (trained at m = k = 16)",
        markdown_table(["m or k", "accuracy %, vary m (k = 16)", "accuracy %, vary k (m = 16)"], budget_rows),
        "## Mechanism swapped at inference",
        markdown_table(["trained with", "evaluated with", "test accuracy %"], swap_rows),
        "Plot: `budget.png`.",
    ])
    return write_result(out_dir, {"budget_rows": budget_rows, "swap_rows": swap_rows, "runs": records},
                        markdown)


def listops_variants() -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "full": ("full", {}),
        "linear": ("linear", {}),
        "local(w=64)": ("local", {"window": 64}),
        "mita(m=k=32)": ("mita", {"landmarks": 32, "topk": 32}),
    }


def listops_settings(quick: bool) -> dict[str, Any]:
    """Quick runs use short expressions (100-300 tokens) so they finish in minutes."""
    if quick:
        return {"min_length": 100, "max_length": 300, "train": 2000, "test": 300, "steps": 300,
                "batch_size": 16}
    # Full attention over 2000 tokens costs ~7 s per batch-16 step on a shared 2-core CPU.
    return {"min_length": 500, "max_length": 2000, "train": 2400, "test": 400, "steps": 300,
            "batch_size": 8}


def run_listops_variant(mechanism: str, options: dict[str, Any], settings: dict[str, Any],
                        seed: int, after_training: Callable[..., dict[str, Any]] | None = None
                        ) -> dict[str, Any]:
    """Train and test one ListOps classifier (2 layers, D=64, 4 heads, mean pooling, non-causal).
    `after_training(model, test_examples)` adds its own entries to the record."""
    from routeformer.data.listops import (
        NUM_CLASSES as LISTOPS_CLASSES,
    )
    from routeformer.data.listops import (
        VOCAB_SIZE,
        ListOpsConfig,
        generate_listops,
        pad_batch,
    )
    from routeformer.models.heads import SequenceClassifier

    grammar = ListOpsConfig(min_length=settings["min_length"], max_length=settings["max_length"])
    train_examples = generate_listops(settings["train"], grammar, seed=1000)
    test_examples = generate_listops(settings["test"], grammar, seed=2000)
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=VOCAB_SIZE, dim=64, depth=2, heads=4, mlp_ratio=2.0, attention=mechanism,
                         attention_options={mechanism: options} if options else {}, causal=False,
                         max_seq_len=settings["max_length"], num_classes=LISTOPS_CLASSES, pooling="mean")
    model = SequenceClassifier(config)

    def make_batch(batch_size: int, generator: torch.Generator):
        index = torch.randint(len(train_examples), (batch_size,), generator=generator).tolist()
        tokens, mask, labels = pad_batch([train_examples[i] for i in index])
        return (tokens, mask), labels

    @torch.no_grad()
    def evaluate(m) -> dict[str, float]:
        m.eval()
        correct, flops, count = 0, 0.0, 0
        for start in range(0, len(test_examples), 32):
            tokens, mask, labels = pad_batch(test_examples[start:start + 32])
            output = m(tokens, mask=mask)
            correct += int((output.logits.argmax(-1) == labels).sum())
            flops += sum(float(layer["flops"]) for layer in output.stats)
            count += int(mask.sum())
        return {"accuracy": correct / len(test_examples), "attention_flops_per_token": flops / count}

    steps = settings["steps"]
    train_config = TaskTrainConfig(steps=steps, batch_size=settings.get("batch_size", 16), lr=1e-3,
                                   warmup_steps=steps // 10,
                                   eval_every=max(1, steps // 4), seed=seed)
    history = train_task(model, make_batch, evaluate, train_config,
                         forward=lambda m, inputs, labels: m(inputs[0], labels, mask=inputs[1]),
                         log=lambda line: log(f"  {line}"))
    majority = max(sum(1 for _, label in test_examples if label == c) for c in range(LISTOPS_CLASSES))
    record = {"mechanism": mechanism, "options": options, "seed": seed, "settings": settings,
              "train_seconds": history.train_seconds, "history": history.evals,
              "majority_accuracy": majority / len(test_examples), **history.final}
    if after_training is not None:
        record.update(after_training(model, test_examples))
    return record


def _listops_verdict(records: dict[str, dict], majority: float) -> str:
    best = max(100 * record["accuracy"] for record in records.values())
    if best <= majority + 2.0:
        return (f"No mechanism learned the task at this budget: the best test accuracy ({best:.1f}%) is "
                f"within 2 points of always answering the majority class ({majority:.1f}%), so this "
                "run compares costs, not quality. LRA's models train for thousands of steps on 96k "
                "expressions.")
    return f"Best test accuracy {best:.1f}% against {majority:.1f}% for the majority class."


@register_experiment("mita-listops", "ListOps (LRA grammar, our generator): full, linear, local, MiTA")
def listops(out_dir: Path, quick: bool) -> Path:
    settings = listops_settings(quick)
    records = {}
    for name, (mechanism, options) in listops_variants().items():
        log(f"mita-listops: {name}")
        records[name] = cached_run(out_dir, run_key(name), lambda m=mechanism, o=options:
                                   run_listops_variant(m, o, settings, seed=0))
    rows = []
    for name, record in records.items():
        paper = PAPER_LISTOPS.get(name.split("(")[0], "-")
        rows.append([name, f"{100 * record['accuracy']:.2f}", paper,
                     f"{record['attention_flops_per_token'] / 1e3:.1f}", round(record["train_seconds"], 1)])
    curves = {name: ([e["step"] for e in r["history"]], [100 * e["accuracy"] for e in r["history"]])
              for name, r in records.items()}
    line_plot(out_dir / "listops_accuracy.png", curves, xlabel="step", ylabel="test accuracy (%)",
              title="ListOps test accuracy over training")
    majority = 100 * next(iter(records.values()))["majority_accuracy"]
    markdown = "\n\n".join([
        "# mita-listops: ListOps from LRA's grammar",
        provenance(f"routeformer reproduce mita-listops{' --quick' if quick else ''}"),
        f"Data: {settings['train']} train / {settings['test']} test expressions of "
        f"{settings['min_length']}-{settings['max_length']} tokens from `data.listops` (depth <= 10, "
        f"<= 10 arguments); the majority class of the test set is {majority:.1f}%. Encoder: 2 layers, "
        f"D=64, 4 heads, rotary positions, mean pooling; AdamW lr 1e-3, batch {settings['batch_size']}, "
        f"{settings['steps']} "
        "steps, one seed. The paper's numbers are LRA ListOps at LRA's scale (96k training "
        "expressions, larger models), quoted for reference, not comparable one to one.",
        markdown_table(["mechanism", "test accuracy % (ours)", "paper (LRA)", "attention kFLOPs/token",
                        "train s"], rows),
        _listops_verdict(records, majority),
        "Plot: `listops_accuracy.png`.",
    ])
    return write_result(out_dir, {"rows": rows, "runs": records}, markdown)


@register_experiment("mita-speed", "mita (non-causal and causal) vs SDPA: time, memory, per-token scaling")
def speed(out_dir: Path, quick: bool) -> Path:
    import json

    from routeformer.bench.mita_bench import SCALING_HEADER, bench_mita, scaling_rows
    from routeformer.bench.ops_bench import TABLE_HEADER, format_row, rows_as_dicts

    lengths = [1024, 4096] if quick else [4096, 16384, 65536, 262144]
    rows = bench_mita(lengths, repeats=2 if quick else 3, progress=lambda line: log(line))
    markdown = "\n\n".join([
        "# mita-speed: MiTA (m = k = 64) against SDPA",
        provenance(f"routeformer reproduce mita-speed{' --quick' if quick else ''}"),
        "B = 1, H = 4, d = 64, fp32. Speedup = SDPA time / MiTA time in the same process (non-causal "
        "MiTA vs non-causal SDPA, causal vs causal); medians of alternating repetitions; peak MiB = "
        "extra resident memory of one call. SDPA is not timed above N = 65536 and causal MiTA not "
        "above 65536 (its own-block term is N²/m).",
        TABLE_HEADER + "\n" + "\n".join(format_row(row) for row in rows),
        "Per token (flat = linear in N):",
        SCALING_HEADER + "\n" + "\n".join(scaling_rows(rows)),
    ])
    (out_dir / "speed.json").write_text(json.dumps(rows_as_dicts(rows), indent=1))
    return write_result(out_dir, {"rows": rows_as_dicts(rows)}, markdown)


LM_VARIANTS = {
    "full": ("full", {}),
    "local(w=64)": ("local", {"window": 64}),
    # Blocks of 512/m tokens, all earlier landmarks in the window: the layout these results were
    # measured with (before the causal layer streamed, blocks were N/m long at every N).
    "mita-causal(m=8,k=32)": ("mita", {"landmarks": 8, "block": 64, "topk": 32}),
    "mita-causal(m=16,k=32)": ("mita", {"landmarks": 16, "block": 32, "topk": 32}),
}


@register_experiment("mita-lm", "char-level LM on WikiText-2 text at T=512: causal MiTA vs full vs local")
def lm(out_dir: Path, quick: bool) -> Path:
    steps = 60 if quick else 300
    return lm_comparison(
        out_dir, "mita-lm", LM_VARIANTS, steps, quick=quick,
        title="# mita-lm: the causal variant on a character-level LM at T = 512",
        description=f"Model: 2 layers, D=128, 4 heads, rotary positions; {steps} steps of batch 16 x 512, "
        "AdamW lr 3e-3, one seed; bits per character on the evaluation split. Causal MiTA with m "
        "landmarks runs blocks of 512/m tokens (block option) with a window of m landmarks, i.e. "
        "every earlier block at T = 512: each query reads the landmarks and one routed expert of "
        "earlier blocks plus its own block exactly. The paper has no causal variant and no "
        "language-model result.")
