"""Reload a patched transformers model saved with `save_pretrained`: the mechanism comes back.

`patch_attention` records `{"mechanism": ..., "options": {...}}` as `config.routeformer`, which
`save_pretrained` writes into config.json. `from_pretrained(path)` reads it, builds the base model
from its config, patches it with the same mechanism and options, and loads the saved safetensors
weights into it (strictly: a missing or unexpected weight raises). `AutoModelForCausalLM.from_pretrained`
alone would build the unpatched base model and leave the routeformer weights unused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from routeformer.integrations.hf.model import RouteformerConfig
from routeformer.integrations.hf.patch import patch_attention

WEIGHTS_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"


def from_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None, **kwargs: Any) -> nn.Module:
    """The model saved in directory `path` by `save_pretrained`, in eval mode: a patched model is
    rebuilt and re-patched (`config.routeformer`), a `RouteformerForCausalLM` loaded as usual.
    `dtype`/`device`: where to put it; other keyword arguments go to `AutoModelForCausalLM.from_config`."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"path: {str(path)!r} is not a directory saved with save_pretrained "
                         "(Hub ids: download first, e.g. huggingface_hub.snapshot_download)")
    config = AutoConfig.from_pretrained(directory)
    if isinstance(config, RouteformerConfig):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
        return model.to(device=device).eval() if device is not None else model.eval()
    entry = getattr(config, "routeformer", None)
    if not isinstance(entry, dict) or "mechanism" not in entry:
        raise ValueError(f"{directory}/config.json has no 'routeformer' entry: it was not saved from a model "
                         "patched by patch_attention (load it with AutoModelForCausalLM.from_pretrained)")
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    patch_attention(model, entry["mechanism"], **entry.get("options", {}))
    load_weights(model, read_safetensors(directory))
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    return model.eval()


def read_safetensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of `directory`'s safetensors weights (one file, or shards listed by an index)."""
    if (directory / WEIGHTS_NAME).exists():
        return load_file(directory / WEIGHTS_NAME)
    if (directory / INDEX_NAME).exists():
        shards = sorted(set(json.loads((directory / INDEX_NAME).read_text())["weight_map"].values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(load_file(directory / shard))
        return state
    raise ValueError(f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME} (save with safe_serialization, the "
                     "default; pickled .bin weights are not read)")


def load_weights(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load `state` strictly, except for weights tied to one that is loaded (GPT-2's lm_head is its
    token embedding; save_pretrained writes such a tensor once)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {id(parameter) for name, parameter in model.named_parameters(remove_duplicate=False)
              if name in state}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    untied = [name for name in missing if name not in by_name or id(by_name[name]) not in loaded]
    if untied or unexpected:
        raise ValueError(f"saved weights do not match the patched model: missing {sorted(untied)}, "
                         f"unexpected {sorted(unexpected)}")
