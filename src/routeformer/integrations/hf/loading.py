"""Reload a patched transformers model saved with `save_pretrained`: the mechanism comes back.

`patch_attention` records `{"mechanism": ..., "options": {...}}` as `config.routeformer`, which
`save_pretrained` writes into config.json, with model_type `PATCHED_MODEL_TYPE` (the base model's
kept as `routeformer.base_model_type`). `from_pretrained(path)` reads it, builds the base model
from its config, patches it with the same mechanism and options, and loads the saved safetensors
weights into it (strictly: a missing or unexpected weight raises). `PatchedConfig` /
`PatchedForCausalLM`, registered with the Auto classes on `import routeformer.integrations.hf`, make
`AutoModelForCausalLM.from_pretrained(path)` do the same; in a process without routeformer,
transformers refuses the unknown model type, and its error names this loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig

from routeformer.integrations.hf.model import RouteformerConfig
from routeformer.integrations.hf.patch import PATCHED_MODEL_TYPE, patch_attention

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
    config = base_config(directory)
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


def base_config(directory: Path) -> PretrainedConfig:
    """The config of the model saved in `directory`: for a patched model's config.json (model_type
    PATCHED_MODEL_TYPE), the base model's config class built from it, `routeformer` entry kept."""
    path = directory / "config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if saved.get("model_type") != PATCHED_MODEL_TYPE:
        return AutoConfig.from_pretrained(directory)
    entry = saved.get("routeformer")
    base = entry.get("base_model_type") if isinstance(entry, dict) else None
    if base not in CONFIG_MAPPING:
        raise ValueError(f"{path}: routeformer.base_model_type {base!r} is not a model type of this "
                         f"transformers ({__import__('transformers').__version__})")
    saved = {key: value for key, value in saved.items() if key != "model_type"}
    saved["routeformer"] = {key: value for key, value in entry.items() if key != "base_model_type"}
    return CONFIG_MAPPING[base].from_dict(saved)


class PatchedConfig(PretrainedConfig):
    """What `AutoConfig` reads from a patched model's config.json once routeformer is imported: the
    saved entries as attributes (`from_pretrained` rebuilds the base model's own config)."""

    model_type = PATCHED_MODEL_TYPE


class PatchedForCausalLM:
    """The Auto classes' entry for PatchedConfig: `AutoModelForCausalLM.from_pretrained(path)` is
    `from_pretrained(path)` (a local directory; `dtype` and a one-device `device_map` are kept)."""

    config_class = PatchedConfig

    @classmethod
    def from_pretrained(cls, path: str | Path, *args: Any, config: Any = None,
                        dtype: torch.dtype | str | None = None, device_map: Any = None,
                        **kwargs: Any) -> nn.Module:
        if args:
            raise TypeError("from_pretrained of a patched routeformer model takes no positional model "
                            f"arguments; got {len(args)}")
        kwargs.pop("torch_dtype", None) if dtype is not None else None
        dtype = kwargs.pop("torch_dtype", dtype)
        hub = {key for key, value in kwargs.items() if (key in HUB_ARGUMENTS and value in (None, False))
               or (key == "use_safetensors" and value in (None, True))}
        unknown = sorted(set(kwargs) - hub)
        if unknown:
            raise TypeError(f"from_pretrained of a patched routeformer model: unsupported arguments "
                            f"{unknown}; it takes dtype and a one-device device_map")
        if config is not None:  # keywords the Auto classes took as config attributes
            saved = AutoConfig.from_pretrained(path)
            changed = sorted({key.removeprefix("_").removesuffix("_internal")
                              for key, value in vars(config).items()
                              if key not in CONFIG_KEPT and vars(saved).get(key, None) != value})
            if changed:
                raise TypeError(f"from_pretrained of a patched routeformer model: unsupported config "
                                f"overrides {changed}; the saved config is loaded as it is")
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if device_map is not None and not isinstance(device_map, (str, torch.device)):
            raise TypeError(f"device_map: a patched routeformer model loads on one device (a str or "
                            f"torch.device); got {device_map!r}")
        return from_pretrained(path, dtype=None if dtype == "auto" else dtype, device=device_map)

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> nn.Module:
        raise TypeError("a patched routeformer config builds no model alone; load the saved directory "
                        "with routeformer.integrations.hf.from_pretrained")

    _from_config = from_config


# Config attributes the Auto classes may set from the keywords PatchedForCausalLM takes itself.
CONFIG_KEPT = ("transformers_version", "dtype", "torch_dtype")
# Hub keywords the Auto classes pass along (a local directory reads none of them).
HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
                 "proxies", "trust_remote_code", "code_revision", "_commit_hash", "adapter_kwargs")


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
