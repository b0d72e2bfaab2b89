"""Pieces the experiment modules share: run names, progress lines, the char-LM run."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from routeformer.models.config import ModelConfig


def run_key(name: str) -> str:
    """A file-name-safe key for a variant name: "topk(K=32,distill)" -> "topk-K32-distill"."""
    return name.replace(",", "-").replace("=", "").replace("(", "-").replace(")", "")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_lm_variant(
    out_dir: Path, mechanism: str, options: dict, steps: int, corpus: str,
    layer_stats: tuple[str, ...] = (), *, seq_len: int = 512, batch_size: int = 16, seed: int = 0,
    log_stats: tuple[str, ...] = (), after_training: Callable[[Any], dict[str, Any]] | None = None,
    meta_density: float = 0.0, dim: int = 128, mlp_ratio: float = 4.0, eval_tokens: int = 32768,
) -> dict[str, Any]:
    """Train the char-LM of the LM experiments (2 layers, 4 heads; D=128, T=512 and batch 16 unless
    told) with one mechanism; resumes from out_dir's checkpoint. `layer_stats`: attention stats to
    average over the layers on 4 validation sequences after training (e.g. expanding's
    `window_mean`); `log_stats`: attention stats logged during training (their history is returned);
    `after_training(TrainResult)` adds its own entries to the record; `meta_density` injects
    meta-tokens (data.meta_density)."""
    from routeformer.data.batches import sequential_batches
    from routeformer.data.corpora import load_corpus
    from routeformer.train.config import DataConfig, RunConfig, TrainConfig
    from routeformer.train.loop import train

    config = RunConfig(
        model=ModelConfig(dim=dim, depth=2, heads=4, mlp_ratio=mlp_ratio, attention=mechanism,
                          attention_options={mechanism: options} if options else {},
                          max_seq_len=seq_len),
        data=DataConfig(corpus=corpus, seq_len=seq_len, meta_density=meta_density),
        train=TrainConfig(steps=steps, batch_size=batch_size, lr=3e-3, warmup_steps=min(100, steps // 5),
                          eval_every=max(1, steps // 4), eval_tokens=eval_tokens,
                          log_every=max(1, steps // 20), checkpoint_every=max(1, steps // 10), seed=seed,
                          log_stats=list(log_stats)),
        out_dir=str(out_dir),
    )
    result = train(config, quiet=True)  # resumes from out_dir/checkpoint.pt if interrupted
    record = {"mechanism": mechanism, "options": options, "steps": steps, "seed": seed,
              "final": result.final_eval, "train_seconds": result.train_seconds}
    if log_stats:
        lines = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
        record["history"] = [{key: line[key] for key in line if key == "step" or key.startswith("attn_")}
                             for line in lines if "loss" in line]
    if layer_stats:
        ids = result.vocab.encode(load_corpus(corpus).val)
        inputs, _ = next(sequential_batches(ids, 4, seq_len))
        model = result.model.eval()
        with torch.no_grad():
            stats = model.backbone(inputs).stats
        record["layer_stats"] = {key: sum(float(layer[key]) for layer in stats) / len(stats)
                                 for key in layer_stats}
    if after_training is not None:
        record.update(after_training(result))
    return record


def run_lm_variants(
    out_dir: Path, experiment: str, variants: dict[str, tuple[str, dict[str, Any]]], steps: int,
    corpus: str = "wikitext2", layer_stats: dict[str, tuple[str, ...]] | None = None,
) -> tuple[str, dict[str, dict[str, Any]]]:
    """Train every variant name -> (mechanism, options) with `run_lm_variant`, each run cached
    under out_dir (a killed experiment resumes after its finished runs). `layer_stats` maps a
    mechanism to the stats to record after training. Returns (corpus name, name -> record)."""
    from routeformer.data.corpora import load_corpus
    from routeformer.experiments.report import cached_run

    corpus_name = load_corpus(corpus).name
    records = {}
    for name, (mechanism, options) in variants.items():
        key = run_key(name)
        log(f"{experiment}: {key}")
        stats = (layer_stats or {}).get(mechanism, ())
        records[name] = cached_run(
            out_dir, key, lambda key=key, mechanism=mechanism, options=options, stats=stats:
                run_lm_variant(out_dir / "train" / key, mechanism, options, steps, corpus, stats))
    return corpus_name, records


def lm_comparison(
    out_dir: Path, experiment: str, variants: dict[str, tuple[str, dict[str, Any]]], steps: int, *,
    title: str, description: str, quick: bool,
) -> Path:
    """Train the char-LM `variants` (one of them named "full") with `run_lm_variants` and write
    the bits-per-character / executed-FLOPs report. `description` follows "Corpus: NAME."."""
    from routeformer.experiments.report import markdown_table, provenance, write_result

    corpus_name, records = run_lm_variants(out_dir, experiment, variants, steps)
    full_flops = records["full"]["final"]["attention_flops_per_token"]
    rows = [[name, r["final"]["bpc"], r["final"]["attention_flops_per_token"],
             r["final"]["attention_flops_per_token"] / full_flops, round(r["train_seconds"], 1)]
            for name, r in records.items()]
    markdown = "\n\n".join([
        title,
        provenance(f"routeformer reproduce {experiment}{' --quick' if quick else ''}"),
        f"Corpus: {corpus_name}. {description}",
        markdown_table(["mechanism", "bits/char", "attention FLOPs/token", "vs full", "train s"], rows),
    ])
    result = {"corpus": corpus_name, "steps": steps,
              "rows": [dict(zip(["mechanism", "bpc", "attention_flops_per_token", "flops_vs_full",
                                 "train_seconds"], row, strict=True)) for row in rows]}
    return write_result(out_dir, result, markdown)
