"""`routeformer export-hf RUN_DIR OUT_DIR`: a checkpoint written by `routeformer train` as a
transformers `RouteformerForCausalLM` directory (config.json, model.safetensors) that
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads once `routeformer.integrations.hf` is
imported. The run's character vocabulary goes beside it as `routeformer_vocab.json`
(`CharVocab.from_dict(json.load(...))` encodes and decodes text for the model)."""

from __future__ import annotations

import json
from pathlib import Path

from routeformer.integrations.hf.model import RouteformerConfig, RouteformerForCausalLM
from routeformer.train.checkpoint import load_trained_model

VOCAB_NAME = "routeformer_vocab.json"


def export_hf(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the newest intact checkpoint of `run_dir` (or a checkpoint file) into `out_dir`
    (created; refused if it exists and is not empty). Returns `out_dir`. The exported model's
    logits equal the checkpoint's (the same weights in the same routeformer modules)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out_dir: {str(out)!r} exists and is not an empty directory; choose a new one")
    model, vocab, run_config = load_trained_model(run_dir)
    config = RouteformerConfig.from_model_config(run_config.model)
    exported = RouteformerForCausalLM(config)
    exported.model.load_state_dict(model.state_dict())
    exported.eval()
    out.mkdir(parents=True, exist_ok=True)
    exported.save_pretrained(out)
    (out / VOCAB_NAME).write_text(json.dumps(vocab.to_dict()))
    return out
