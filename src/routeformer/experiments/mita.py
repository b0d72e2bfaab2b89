"""MiTA experiments: `routeformer reproduce mita-{digits-vit,speed}`; `mita-listops` (with the
budget-at-inference and swap evaluations) runs on the shared tasks layer (experiments/mita_tasks.py).

- mita-digits-vit: a small ViT on scikit-learn's 8×8 digits (64 patches + CLS) and upsampled to
  16×16 (256 + CLS): full, linear, agent, route-only and MiTA at equal budget, 3 seeds.
- mita-speed: `bench_mita` (non-causal and causal MiTA vs SDPA up to N = 262144).
Every training run is cached under out_dir/runs (a killed experiment resumes after its finished
runs).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from routeformer.data.digits import NUM_CLASSES, ImageSplit, load_digits
from routeformer.experiments.registry import register_experiment
from routeformer.models.config import ModelConfig
from routeformer.models.vit import VisionConfig, ViT
from routeformer.runner.jobs import Call, call, finished_records, run_jobs, run_key, say
from routeformer.runner.report import line_plot, markdown_table, mean_sd, provenance, write_result
from routeformer.runner.seeds import seed_grid
from routeformer.train.schedule import Schedule
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

    config = TaskTrainConfig(Schedule(steps=steps, batch_size=64, lr=2e-3, warmup_steps=steps // 10),
                             weight_decay=0.05, eval_every=max(1, steps // 4), seed=seed)
    history = train_task(model, make_batch, lambda m: vit_accuracy(m, test_split), config,
                         log=lambda line: say(f"  {line}"))
    record = {"mechanism": mechanism, "options": options, "size": size, "seed": seed, "steps": steps,
              "train_seconds": history.train_seconds, "history": history.evals, **history.final}
    return model, record


def vit_record(mechanism: str, options: dict[str, Any], size: int, seed: int, steps: int) -> dict:
    """The record of `train_vit` (a `Call` job's function: the model is not kept)."""
    return train_vit(mechanism, options, size, seed, steps)[1]


@register_experiment("mita-digits-vit", "ViT on 8x8 / 16x16 digits: full, linear, agent, route-only, "
                     "MiTA; accuracy and attention FLOPs, 3 seeds")
def digits_vit(out_dir: Path, quick: bool) -> Path:
    sizes = [8] if quick else [8, 16]
    seeds = [0] if quick else [0, 1, 2]
    steps = {8: 150 if quick else 600, 16: 250}
    grid = [(size, name, mechanism, options) for size in sizes
            for name, (mechanism, options) in vit_variants().items()]
    cells = [((size, name), Call(run_key(f"S{size}-{name}-seed{seed}"), vit_record,
                                 {"mechanism": mechanism, "options": options, "size": size, "seed": seed,
                                  "steps": steps[size]}))
             for (size, name, mechanism, options), seed in seed_grid(grid, seeds, seed_major=False)]
    done = finished_records(run_jobs(out_dir, [job for _, job in cells], 1 if quick else 2, say, train=call),
                            "mita-digits-vit")
    records: dict[tuple[int, str], list[dict]] = {}
    for cell, job in cells:
        records.setdefault(cell, []).append(done[job.key])
    rows = []
    for (size, name), runs in records.items():
        accuracy, spread = mean_sd([100 * run["accuracy"] for run in runs])
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
        "(mean ± sd). Attention FLOPs: executed, all layers, per image (`stats['flops']`). "
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


@register_experiment("mita-speed", "mita (non-causal and causal) vs SDPA: time, memory, per-token scaling")
def speed(out_dir: Path, quick: bool) -> Path:
    import json

    from routeformer.bench.mita_bench import SCALING_HEADER, bench_mita, scaling_rows
    from routeformer.bench.ops_bench import TABLE_HEADER, format_row, rows_as_dicts

    lengths = [1024, 4096] if quick else [4096, 16384, 65536, 262144]
    rows = bench_mita(lengths, repeats=2 if quick else 3, progress=lambda line: say(line))
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
