"""Checkpoints that resume exactly: model, optimizer, step, every RNG, vocabulary, config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write atomically (temp file + rename): a run killed mid-write keeps its last checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    return torch.load(path, map_location="cpu", weights_only=False)


def load_trained_model(path: str | Path):
    """(CausalLM in eval mode, CharVocab, RunConfig) from a run directory or checkpoint file."""
    from routeformer.data.vocab import CharVocab
    from routeformer.models.heads import CausalLM
    from routeformer.train.config import RunConfig

    state = load_checkpoint(path)
    config = RunConfig.from_dict(state["config"])
    model = CausalLM(config.model)
    model.load_state_dict(state["model"])
    return model.eval(), CharVocab.from_dict(state["vocab"]), config
