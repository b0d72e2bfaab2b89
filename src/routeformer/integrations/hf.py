"""Hugging Face `transformers` integration: run a GPT-2 or Llama-family model with any routeformer
mechanism in place of its attention.

    from transformers import AutoModelForCausalLM
    from routeformer.integrations.hf import patch_attention, routeformer_aux_loss

    model = AutoModelForCausalLM.from_pretrained("gpt2")
    patch_attention(model, "local", window=128)
    out = model(input_ids, labels=input_ids)
    loss = out.loss + routeformer_aux_loss(model)   # Meta-Attention's KL, top-k's distillation, ...

Every attention module (GPT-2's `c_attn`/`c_proj`; Llama-style `q_proj`/`k_proj`/`v_proj`/`o_proj`,
also Mistral and Qwen2) is swapped for a `RouteformerAttention` holding a routeformer layer built
with the model's width, heads and head size. The pretrained Q/K/V/O weights are copied into the
layer's projections (into every expert's, for `meta`); grouped-query K/V heads are repeated, which is
exactly what the original computes. Parameters the original has no counterpart for (routers,
controllers, gates) start fresh. Llama-style rotary embeddings become the layer's own (same
half-split convention, base `rope_theta`); GPT-2's learned positions stay outside attention.

What the swap does not carry: transformers' key/value cache (the patched model generates with
`use_cache=False`, re-reading the context each step), attention weights (`output_attentions`
returns None), and RoPE scaling variants or q/k norms (rejected with a ValueError).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from routeformer.attention import build_attention


class RouteformerAttention(nn.Module):
    """Stands where a transformers attention module stood; returns (attn_output, None)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.last_aux_loss: Tensor | None = None
        self.last_stats: dict[str, Tensor] = {}

    def forward(self, hidden_states: Tensor, *args: Any, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        batch, length, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=hidden_states.device)
        positions = position_ids.expand(batch, length)
        result = self.layer(hidden_states, mask=key_padding_mask(attention_mask, batch, length),
                            positions=positions)
        self.last_aux_loss, self.last_stats = result.aux_loss, result.stats
        return result.out, None


def key_padding_mask(attention_mask: Tensor | None, batch: int, length: int) -> Tensor | None:
    """transformers' 4-D attention mask ([B, 1, T, T]: bool True = may attend, or additive float with
    large negatives) -> routeformer's key padding mask [B, T] (True = real token), None if none.
    A real key is read by its own query at least (the causal diagonal); a padded key by none."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise ValueError(f"attention_mask: unsupported type {type(attention_mask).__name__}; use "
                         "attn_implementation='eager' or 'sdpa'")
    if attention_mask.dim() == 2:
        real = attention_mask.bool()
    elif attention_mask.dim() == 4:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1e4
        real = allowed[:, 0, -length:, -length:].any(dim=-2)
    else:
        raise ValueError(f"attention_mask must be [B, T] or [B, 1, T, T]; got {tuple(attention_mask.shape)}")
    real = real.expand(batch, length)
    return None if bool(real.all()) else real


def _rope_base(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only the default rotary embedding)")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


Weights = tuple[Tensor, Tensor | None, Tensor, Tensor | None, int, int]  # qkv w, b; out w, b; heads; head dim


def _gpt2_weights(module: nn.Module) -> Weights:
    # Conv1D stores weight [in, out] (y = x W + b): transpose to nn.Linear's [out, in].
    heads = module.num_heads
    return (module.c_attn.weight.t(), module.c_attn.bias, module.c_proj.weight.t(), module.c_proj.bias,
            heads, module.head_dim)


def _llama_weights(module: nn.Module, config) -> Weights:
    if hasattr(module, "q_norm") or hasattr(module, "k_norm"):
        raise ValueError(f"{type(module).__name__} normalises q and k; routeformer layers have no q/k norm")
    heads, head_dim = config.num_attention_heads, module.head_dim
    groups = heads // getattr(config, "num_key_value_heads", heads)

    def expand(projection: nn.Linear) -> tuple[Tensor, Tensor | None]:
        # Grouped-query attention: query head h reads K/V head h // groups (transformers' repeat_kv).
        weight = projection.weight.unflatten(0, (-1, head_dim)).repeat_interleave(groups, 0).flatten(0, 1)
        bias = projection.bias
        if bias is not None:
            bias = bias.unflatten(0, (-1, head_dim)).repeat_interleave(groups, 0).flatten(0, 1)
        return weight, bias

    (k_weight, k_bias), (v_weight, v_bias) = expand(module.k_proj), expand(module.v_proj)
    qkv_weight = torch.cat([module.q_proj.weight, k_weight, v_weight])
    biases = [module.q_proj.bias, k_bias, v_bias]
    qkv_bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else qkv_weight.new_zeros(heads * head_dim) for b in biases])
    return qkv_weight, qkv_bias, module.o_proj.weight, module.o_proj.bias, heads, head_dim


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


def patch_attention(model: nn.Module, mechanism: str, **options: Any) -> nn.Module:
    """Swap every attention module of `model` (in place) for routeformer's `mechanism` built with
    `options`; returns the model. See the module docstring for what is kept and what starts fresh."""
    config = model.config
    swapped = 0
    for name, module in list(model.named_modules()):
        if hasattr(module, "c_attn") and hasattr(module, "c_proj") and hasattr(module, "num_heads"):
            if getattr(module, "is_cross_attention", False):
                raise ValueError(f"{name}: cross-attention is not supported")
            weights, rotary = _gpt2_weights(module), {}
        elif all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            weights = _llama_weights(module, config)
            rotary = {"rotary": True, "rotary_base": _rope_base(config)}
        else:
            continue
        qkv_weight, qkv_bias, out_weight, out_bias, heads, head_dim = weights
        has_bias = qkv_bias is not None or out_bias is not None
        layer = build_attention(mechanism, dim=config.hidden_size, heads=heads, causal=True,
                                head_dim=head_dim, bias=has_bias, **rotary, **options)
        layer.to(dtype=qkv_weight.dtype, device=qkv_weight.device)
        _copy_projections(layer, qkv_weight, qkv_bias, out_weight, out_bias)
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, RouteformerAttention(layer))
        swapped += 1
    if not swapped:
        raise ValueError(f"{type(model).__name__}: no GPT-2 or Llama-style attention module found")
    # transformers' KV cache holds keys the swapped layers never read: generate by re-reading.
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
