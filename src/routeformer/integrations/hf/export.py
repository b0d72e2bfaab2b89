"""`routeformer export-hf RUN_DIR OUT_DIR`: a trained run's checkpoint as a transformers
`RouteformerForCausalLM` directory (config.json, model.safetensors) that
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads once `routeformer.integrations.hf` is
imported. A `routeformer train` run converts when its model is causal (lm, code_lm, mqar, ...; a
bidirectional task's model, such as listops', is not a causal LM and is refused), and so does an LM
run directory of the earlier layout. A run's tokeniser goes beside it as
`routeformer_vocab.json` (`tokenizer_from_dict(json.load(...))` encodes and decodes text for the
model; a task of abstract tokens has none), and `routeformer_run.json` says where the weights came
from: the checkpoint file, its step and, for a task run, the task's name and options."""

from __future__ import annotations

import json
from pathlib import Path

from routeformer.integrations.hf.model import RouteformerConfig, RouteformerForCausalLM
from routeformer.train.checkpoint import checkpoint_for_use, is_task_model, task_model, trained_model

VOCAB_NAME = "routeformer_vocab.json"
RUN_NAME = "routeformer_run.json"


def export_hf(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the checkpoint of `run_dir` that `routeformer eval` reads (`checkpoint_for_use`: the
    newest, when intact; or a checkpoint file) into `out_dir` (created; refused if it exists and is
    not empty). Returns `out_dir`. The exported model's logits equal the checkpoint's (the same
    weights in the same routeformer modules).

    Raises CheckpointError when the run directory's newest checkpoint is missing or unreadable (the
    message names the newest intact file and its step), ValueError for a task run whose model is
    not causal."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out_dir: {str(out)!r} exists and is not an empty directory; choose a new one")
    file, state = checkpoint_for_use(run_dir)
    task = state["task"] if is_task_model(state) else None
    if task is not None:
        model, vocab = task_model(state)
        if not model.config.causal:
            raise ValueError(f"export-hf: {str(run_dir)!r} is a run of task {task['name']!r}, whose model "
                             "reads the whole sequence (causal=False); export-hf writes causal language "
                             "models (RouteformerForCausalLM), so it has no transformers form")
    else:
        model, vocab, _ = trained_model(state)
    config = RouteformerConfig.from_model_config(model.config)
    exported = RouteformerForCausalLM(config)
    exported.model.load_state_dict(model.state_dict())
    exported.eval()
    out.mkdir(parents=True, exist_ok=True)
    exported.save_pretrained(out)
    if vocab is not None:
        (out / VOCAB_NAME).write_text(json.dumps(vocab.to_dict()))
    source = {"checkpoint": str(file), "step": state.get("step"), **({"task": task} if task else {})}
    (out / RUN_NAME).write_text(json.dumps(source, indent=1) + "\n")
    return out
