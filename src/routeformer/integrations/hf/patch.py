"""Swap the attention of a transformers GPT-2 or Llama-family model for a routeformer mechanism.

    from transformers import AutoModelForCausalLM
    from routeformer.integrations.hf import patch_attention, routeformer_aux_loss

    model = AutoModelForCausalLM.from_pretrained("gpt2")
    patch_attention(model, "local", window=128)
    out = model(input_ids, labels=input_ids)
    loss = out.loss + routeformer_aux_loss(model)   # Meta-Attention's KL, top-k's distillation, ...

Every attention module (GPT-2's `c_attn`/`c_proj`; Llama-style `q_proj`/`k_proj`/`v_proj`/`o_proj`,
also Mistral and Qwen2) is swapped for a `RouteformerAttention` holding a routeformer layer built
with the model's width, heads and head size. The pretrained Q/K/V/O weights are copied into the
layer's projections (into every expert's, for `meta`). Grouped-query attention (Llama's
`num_key_value_heads` < heads): a mechanism that takes `kv_heads` (`reads_grouped_kv`) is built with
kv_heads = the model's K/V heads and gets k_proj/v_proj as they are, so the patched model holds the
original's parameters and decode-cache bytes; for the others the K/V heads are repeated per query
head (query head h reads K/V head h // (heads / kv_heads), transformers' repeat_kv), which computes
the same function with larger projections. Parameters the original has no counterpart for (routers,
controllers, gates) start fresh. Llama-style rotary embeddings become the layer's own (same
half-split convention, base `rope_theta`); GPT-2's learned positions stay outside attention.

Attention the swap would not reproduce is refused with a ValueError naming the feature, before
anything is changed: sliding windows (Mistral, Qwen2 with use_sliding_window, Gemma2/3's local
layers), logit soft-capping (Gemma2), a scale other than 1/sqrt(head_dim) (Gemma's
query_pre_attn_scalar, GPT-2's scale_attn_by_inverse_layer_idx), q/k norms, chunked attention,
RoPE scaling variants, cross-attention. Not carried either: attention dropout (GPT-2's attn_pdrop
acts in training only) and attention weights (`output_attentions` returns None).

The mechanism and its options are recorded in `model.config.routeformer` (saved in config.json), so
`routeformer.integrations.hf.from_pretrained` can rebuild the patched model. The patched model's
`save_pretrained` writes config.json with model_type `PATCHED_MODEL_TYPE`: after `import
routeformer.integrations.hf`, `AutoModelForCausalLM.from_pretrained` loads the directory re-patched
too; without it, transformers refuses the directory with an error naming the loader (an unknown
model type), rather than building the unpatched model. Cached generation: see `RouteformerAttention`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.attention import attention_class, build_attention
from routeformer.integrations.hf.cache import cache_layer, check_usable
from routeformer.integrations.hf.compat import passed_cache, refuse_untested_cache, untested_reason
from routeformer.models.ragged import decode_rows, is_ragged, ragged_positions, start_ragged


class RouteformerAttention(nn.Module):
    """Stands where a transformers attention module stood; returns (attn_output, None).

    With `past_key_values` (use_cache=True) the layer decodes incrementally with routeformer's own
    decode cache, kept in its slot of transformers' cache (integrations/hf/cache.py): exactly the
    function of the uncached pass. A padded (left- or right-padded) prompt batch keeps one state per
    row, and each row generates what its prompt generates alone. A prompt the cache cannot continue
    from exactly (training mode, a mechanism without cached decoding) is still answered exactly,
    and the next cached step raises a ValueError saying to pass use_cache=False.
    """

    def __init__(self, layer: nn.Module, layer_index: int, mechanism: str) -> None:
        super().__init__()
        self.layer = layer
        self.layer_index = layer_index
        self.mechanism = mechanism
        self.last_aux_loss: Tensor | None = None
        self.last_stats: dict[str, Tensor] = {}

    def forward(self, hidden_states: Tensor, *args: Any, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Any = None, cache: Any = None,
                **kwargs: Any) -> tuple[Tensor, None]:
        # transformers >= 5.24 passes the cache as `cache`, earlier releases as `past_key_values`.
        transformers_cache = passed_cache(args, kwargs, past_key_values, cache)
        refuse_untested_cache(transformers_cache)
        batch, length, _ = hidden_states.shape
        cache = None if transformers_cache is None else cache_layer(transformers_cache, self.layer_index)
        past = 0 if cache is None else cache.length
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=hidden_states.device)
        positions = position_ids.expand(batch, length)
        real = key_padding_mask(attention_mask, batch, length, past)
        if cache is not None:
            check_usable(cache)
            reason = self._cannot_decode()
            if reason is None:
                out = self._decode(hidden_states, positions, real, cache, past)
                cache.length += length
                self.last_aux_loss, self.last_stats = hidden_states.new_zeros(()), {}
                return out, None
            if past:
                raise ValueError(f"cached generation cannot continue exactly: {reason}; pass use_cache=False")
            cache.length, cache.unusable = length, reason  # this pass is exact; continuing would not be
        if real is not None:
            real = real[:, past:]
        result = self.layer(hidden_states, mask=real, positions=positions)
        self.last_aux_loss, self.last_stats = result.aux_loss, result.stats
        return result.out, None

    def _decode(self, hidden_states: Tensor, positions: Tensor, real: Tensor | None, cache,
                past: int) -> Tensor:
        """One cached step. A padded prompt makes every row keep its own state (models/ragged.py),
        each row then continuing as it would alone, with positions counted over its real tokens."""
        new_real = None if real is None else real[:, past:]
        if not is_ragged(cache.state):
            if new_real is None:
                return self.layer.decode(hidden_states, positions=positions, cache=cache.state)
            if past:
                raise ValueError("cached generation cannot continue exactly: padding after an unpadded "
                                 "prompt; pass use_cache=False")
            start_ragged(cache.state, hidden_states.shape[0], hidden_states.device)
        if new_real is None:
            new_real = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
        positions = ragged_positions(cache.state, new_real)
        return decode_rows(self.layer, hidden_states, new_real, positions, cache.state)

    def _cannot_decode(self) -> str | None:
        if not self.layer.supports_cache:
            return f"routeformer mechanism {self.mechanism!r} has no cached decoding"
        if self.training:
            return "the cache was filled in training mode (aux losses and routing noise need the full pass)"
        return None


def key_padding_mask(attention_mask: Tensor | None, batch: int, length: int, past: int = 0) -> Tensor | None:
    """transformers' attention mask ([B, 1, T, past+T] or wider: bool True = may attend, or additive
    float with large negatives; or [B, past+T]) -> which of the past+T keys are real tokens, bool
    [B, past+T], or None when all are. A real key is read by at least one of the T queries (its own,
    or every one for a cached key); a padded key by none."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise ValueError(f"attention_mask: unsupported type {type(attention_mask).__name__}; use "
                         "attn_implementation='eager' or 'sdpa'")
    total = past + length
    if attention_mask.dim() == 2:
        real = attention_mask[:, -total:].bool()
    elif attention_mask.dim() == 4:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1e4
        real = allowed[:, 0, -length:, :total].any(dim=-2)
    else:
        raise ValueError(f"attention_mask must be [B, T] or [B, 1, T, T]; got {tuple(attention_mask.shape)}")
    if real.shape[-1] != total:
        raise ValueError(f"attention_mask covers {real.shape[-1]} keys; expected {total} (past + new tokens)")
    real = real.expand(batch, total)
    return None if bool(real.all()) else real


def refusal(module: nn.Module, config: Any, head_dim: int) -> str | None:
    """The attention feature of `module` the swap would not reproduce, or None."""
    window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
    if window is not None:
        return f"sliding-window attention (sliding_window={window})"
    if getattr(config, "attention_chunk_size", None) is not None:
        return f"chunked attention (attention_chunk_size={config.attention_chunk_size})"
    softcap = getattr(module, "attn_logit_softcapping", getattr(config, "attn_logit_softcapping", None))
    if softcap is not None:
        return f"attention logit soft-capping (attn_logit_softcapping={softcap})"
    scaling = getattr(module, "scaling", None)
    if scaling is not None and not math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-6):
        return (f"attention scale {scaling:.6g} (routeformer layers scale by 1/sqrt(head_dim) = "
                f"{head_dim ** -0.5:.6g})")
    if hasattr(module, "q_norm") or hasattr(module, "k_norm"):
        return "q/k normalisation (q_norm/k_norm)"
    if getattr(module, "is_cross_attention", False):
        return "cross-attention"
    if getattr(module, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", None):
        return "bidirectional (non-causal) attention"
    return None


def _rope_base(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only the default rotary embedding)")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


# qkv w, b; out w, b; heads; K/V heads of the qkv rows; head dim
Weights = tuple[Tensor, Tensor | None, Tensor, Tensor | None, int, int, int]


def _gpt2_weights(module: nn.Module) -> Weights:
    # Conv1D stores weight [in, out] (y = x W + b): transpose to nn.Linear's [out, in].
    return (module.c_attn.weight.t(), module.c_attn.bias, module.c_proj.weight.t(), module.c_proj.bias,
            module.num_heads, module.num_heads, module.head_dim)


def _llama_weights(module: nn.Module, config, grouped: bool) -> Weights:
    """The Llama-style projections as one qkv block: with `grouped`, k_proj/v_proj as they are
    (kv_heads = the model's K/V heads); otherwise each K/V head repeated for its query heads."""
    heads, head_dim = config.num_attention_heads, module.head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    groups = 1 if grouped else heads // kv_heads

    def expand(projection: nn.Linear) -> tuple[Tensor, Tensor | None]:
        # Query head h reads K/V head h // groups (transformers' repeat_kv).
        weight, bias = projection.weight, projection.bias
        if groups == 1:
            return weight, bias
        weight = weight.unflatten(0, (-1, head_dim)).repeat_interleave(groups, 0).flatten(0, 1)
        if bias is not None:
            bias = bias.unflatten(0, (-1, head_dim)).repeat_interleave(groups, 0).flatten(0, 1)
        return weight, bias

    (k_weight, k_bias), (v_weight, v_bias) = expand(module.k_proj), expand(module.v_proj)
    qkv_weight = torch.cat([module.q_proj.weight, k_weight, v_weight])
    biases = [(module.q_proj.bias, heads), (k_bias, k_weight.shape[0] // head_dim),
              (v_bias, v_weight.shape[0] // head_dim)]
    qkv_bias = None if all(b is None for b, _ in biases) else torch.cat(
        [b if b is not None else qkv_weight.new_zeros(rows * head_dim) for b, rows in biases])
    return (qkv_weight, qkv_bias, module.o_proj.weight, module.o_proj.bias, heads,
            k_weight.shape[0] // head_dim, head_dim)


def _copy_projections(layer: nn.Module, qkv_weight: Tensor, qkv_bias: Tensor | None, out_weight: Tensor,
                      out_bias: Tensor | None) -> None:
    # Meta-Attention has one projection set per expert (or one shared Q/K/V): each gets the weights.
    qkv_modules = list(layer.expert_qkv) if hasattr(layer, "expert_qkv") else [layer.qkv_proj]
    out_modules = list(layer.expert_out) if hasattr(layer, "expert_out") else [layer.out_proj]
    with torch.no_grad():
        for target, weight, bias in ([(m, qkv_weight, qkv_bias) for m in qkv_modules]
                                     + [(m, out_weight, out_bias) for m in out_modules]):
            target.weight.copy_(weight)
            if target.bias is not None:
                target.bias.copy_(bias if bias is not None else torch.zeros_like(target.bias))


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, family) of every GPT-2 or Llama-style attention module, checked: a feature
    the swap would not reproduce raises before anything is changed."""
    config = model.config
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "c_attn") and hasattr(module, "c_proj") and hasattr(module, "num_heads"):
            family = "gpt2"
        elif all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            family = "llama"
        else:
            continue
        head_dim = module.head_dim
        reason = refusal(module, config, head_dim)
        if reason is not None:
            raise ValueError(f"{type(model).__name__}.{name}: routeformer cannot reproduce {reason}; "
                             "refusing to swap it silently")
        if family == "llama":
            _rope_base(config)  # raises on RoPE scaling variants
        found.append((name, module, family))
    if not found:
        raise ValueError(f"{type(model).__name__}: no GPT-2 or Llama-style attention module found")
    return found


# The model_type a patched model's config.json is saved with: transformers' Auto classes do not
# know it, so a process without routeformer refuses to load the directory and names the loader in its
# error, instead of building the unpatched model around unused weights; `import
# routeformer.integrations.hf` registers it (loading.py), and the Auto classes load it re-patched.
PATCHED_MODEL_TYPE = "routeformer.integrations.hf.from_pretrained"


def _save_patched(model: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """`save_pretrained` of a patched model: transformers' own, then config.json's model_type becomes
    PATCHED_MODEL_TYPE (the base model's is kept as `routeformer.base_model_type`)."""
    result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
    path = Path(save_directory) / "config.json"
    if not path.is_file():  # a process that is not the main one writes no config
        return result
    saved = json.loads(path.read_text())
    if saved.get("model_type") != PATCHED_MODEL_TYPE:
        saved["routeformer"] = {**saved["routeformer"], "base_model_type": saved["model_type"]}
        saved["model_type"] = PATCHED_MODEL_TYPE
        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return result


def patch_attention(model: nn.Module, mechanism: str, **options: Any) -> nn.Module:
    """Swap every attention module of `model` (in place) for routeformer's `mechanism` built with
    `options`; returns the model. Train/eval mode, device and dtype are kept. See the module
    docstring for what is kept, what starts fresh and what is refused.

    Raises TypeError if `model` is not a transformers model (an nn.Module with a `config`, such
    as GPT2LMHeadModel or LlamaForCausalLM), ValueError if it is patched already."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers model (a PreTrainedModel such as GPT2LMHeadModel "
                        f"or LlamaForCausalLM, with a .config); got {type(model).__name__}")
    if routeformer_layers(model):
        raise ValueError(f"model is already patched with routeformer's "
                         f"{getattr(model.config, 'routeformer', {}).get('mechanism', '?')!r} attention; "
                         f"patch a fresh model")
    config = model.config
    if "kv_heads" in options:
        raise ValueError(f"kv_heads={options['kv_heads']!r}: patch_attention takes the K/V heads from the "
                         "model (num_key_value_heads); do not pass kv_heads")
    found = _attention_modules(model)
    grouped = attention_class(mechanism).reads_grouped_kv
    for index, (name, module, family) in enumerate(found):
        if family == "gpt2":
            weights, rotary = _gpt2_weights(module), {}
        else:
            weights = _llama_weights(module, config, grouped)
            rotary = {"rotary": True, "rotary_base": _rope_base(config)}
        qkv_weight, qkv_bias, out_weight, out_bias, heads, kv_heads, head_dim = weights
        has_bias = qkv_bias is not None or out_bias is not None
        layer = build_attention(mechanism, dim=config.hidden_size, heads=heads, causal=True,
                                head_dim=head_dim, bias=has_bias, kv_heads=kv_heads, **rotary, **options)
        layer.to(dtype=qkv_weight.dtype, device=qkv_weight.device)
        _copy_projections(layer, qkv_weight, qkv_bias, out_weight, out_bias)
        layer_index = getattr(module, "layer_idx", None)
        replacement = RouteformerAttention(layer, index if layer_index is None else layer_index, mechanism)
        replacement.train(module.training)
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, replacement)
    config.routeformer = {"mechanism": mechanism, "options": dict(options)}
    model.save_pretrained = MethodType(_save_patched, model)
    if not routeformer_layers(model)[0].layer.supports_cache or untested_reason() is not None:
        # Generation by default would stop with a ValueError (no cached decoding, or a transformers
        # release outside the tested range: compat.py); re-read the context instead.
        config.use_cache = False
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.use_cache = False
    return model


def routeformer_layers(model: nn.Module) -> list[RouteformerAttention]:
    return [module for module in model.modules() if isinstance(module, RouteformerAttention)]


def routeformer_aux_loss(model: nn.Module) -> Tensor:
    """The summed aux_loss of the swapped layers from the last forward pass (add it to the loss)."""
    losses = [m.last_aux_loss for m in routeformer_layers(model) if m.last_aux_loss is not None]
    if not losses:
        raise ValueError("no forward pass through a patched model yet")
    return torch.stack(losses).sum()
