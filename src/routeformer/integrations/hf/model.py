"""routeformer's causal LM as a transformers model: `RouteformerConfig` and `RouteformerForCausalLM`.

    from transformers import AutoModelForCausalLM
    import routeformer.integrations.hf  # registers model_type "routeformer" with the Auto classes

    model = AutoModelForCausalLM.from_pretrained("out/my-export")
    model.generate(input_ids, max_new_tokens=20, do_sample=False)   # cached where the mechanism can

The transformers model wraps routeformer's own `CausalLM` (`model.model`), so the weights, the
mechanisms and the decode caches are routeformer's; transformers adds save/load (safetensors),
the Auto classes and `generate`. `labels` follow transformers (unshifted; -100 ignored); `loss` is
the next-token loss plus the attention layers' aux loss (Meta-Attention's KL, ...), which is also
returned alone as `aux_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from routeformer.integrations.hf.cache import cache_layer, check_usable
from routeformer.integrations.hf.compat import passed_cache, refuse_untested_cache, untested_reason
from routeformer.models.cache import DecodeCache
from routeformer.models.config import ModelConfig
from routeformer.models.heads import IGNORE_INDEX, CausalLM
from routeformer.models.ragged import is_ragged
from routeformer.models.transformer import Block, init_weights

# ModelConfig's fields a causal LM uses (num_classes and pooling belong to the classifier head).
MODEL_FIELDS = ("vocab_size", "dim", "depth", "heads", "mlp_ratio", "attention", "attention_options",
                "positions", "max_seq_len", "dropout", "tie_embeddings", "meta_token_id",
                "zero_meta_positions_train", "zero_meta_positions_eval")


class RouteformerConfig(PreTrainedConfig):
    """A routeformer `ModelConfig` (same field names and defaults) as a transformers config."""

    model_type = "routeformer"
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "depth", "num_attention_heads": "heads",
                     "max_position_embeddings": "max_seq_len"}

    vocab_size: int = 256
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    attention: str | list[str] = "full"
    attention_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    positions: str = "rotary"
    max_seq_len: int = 1024
    dropout: float = 0.0
    tie_embeddings: bool = True
    meta_token_id: int | None = None
    zero_meta_positions_train: bool = False
    zero_meta_positions_eval: bool = False
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        self.tie_word_embeddings = self.tie_embeddings
        super().__post_init__(**kwargs)
        self.to_model_config()  # validates: a bad value raises here, naming the field

    def to_model_config(self) -> ModelConfig:
        return ModelConfig(causal=True, **{name: getattr(self, name) for name in MODEL_FIELDS})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs: Any) -> RouteformerConfig:
        if not config.causal:
            raise ValueError("RouteformerConfig: model.causal must be True (a causal LM)")
        values = config.to_dict()
        return cls(**{name: values[name] for name in MODEL_FIELDS}, **kwargs)


# The output's cache field: `cache` from transformers 5.24 on, `past_key_values` before.
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


@dataclass
class RouteformerCausalLMOutput(CausalLMOutputWithPast):
    """transformers' causal-LM output plus the attention layers' summed aux loss (in `loss` too)."""

    aux_loss: Tensor | None = None


class RouteformerForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = RouteformerConfig
    config: RouteformerConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    # Read only when config.tie_word_embeddings (= tie_embeddings, set in RouteformerConfig).
    _tied_weights_keys = {"model.lm_head.weight": "model.backbone.token_embedding.weight"}

    def __init__(self, config: RouteformerConfig) -> None:
        super().__init__(config)
        self.model = CausalLM(config.to_model_config())  # ties lm_head to the embedding if tie_embeddings
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> RouteformerForCausalLM:
        model = super().from_pretrained(*args, **kwargs)
        model.restore_computed_buffers()
        return model

    def restore_computed_buffers(self) -> None:
        """Recompute the buffers a checkpoint does not hold (non-persistent: Meta-Attention's cost
        prior). transformers builds the model on the meta device before loading the weights, so
        they would be left uninitialised; each block that has one is rebuilt on the CPU to copy them."""
        model_config = self.config.to_model_config()
        mechanisms = model_config.layer_attention()
        for index, block in enumerate(self.model.backbone.blocks):
            names = [f"{prefix}.{name}".lstrip(".") for prefix, module in block.named_modules()
                     for name in module._non_persistent_buffers_set]
            if not names:
                continue
            with torch.device("cpu"):
                fresh = Block(model_config, mechanisms[index])
            fresh_buffers = dict(fresh.named_buffers())
            for name in names:
                target = block.get_buffer(name)
                owner_name, _, attribute = name.rpartition(".")
                owner = block.get_submodule(owner_name) if owner_name else block
                owner._buffers[attribute] = fresh_buffers[name].to(device=target.device, dtype=target.dtype)

    def _init_weights(self, module: torch.nn.Module) -> None:
        init_weights(module)  # routeformer's own initialisation (what CausalLM does)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.backbone.token_embedding

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.model.lm_head

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Any = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, cache: Any = None,
                **kwargs: Any) -> RouteformerCausalLMOutput:
        """transformers' causal-LM call. `attention_mask` [B, past+T] (1 = real token);
        `cache` (transformers >= 5.24; `past_key_values` before) a transformers Cache that
        routeformer's decode caches live in."""
        past_key_values = passed_cache((), kwargs, past_key_values, cache)
        tokens = input_ids
        if (tokens is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        shape_source = tokens if tokens is not None else inputs_embeds
        batch, length = shape_source.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None and untested_reason() is None:
            from transformers import DynamicCache
            past_key_values = DynamicCache()
        if not use_cache:
            past_key_values = None
        refuse_untested_cache(past_key_values)
        blocks = self.model.backbone.blocks
        layers = None
        if past_key_values is not None:
            layers = [cache_layer(past_key_values, index) for index in range(len(blocks))]
        past = 0 if layers is None else layers[0].length
        real = None
        if attention_mask is not None:
            if attention_mask.shape != (batch, past + length):
                raise ValueError(f"attention_mask must be [B, past + T] = {(batch, past + length)}; "
                                 f"got {tuple(attention_mask.shape)}")
            real = None if bool(attention_mask.bool().all()) else attention_mask.bool()
        positions = None if position_ids is None else position_ids.expand(batch, length)
        backbone_tokens = tokens if tokens is not None else torch.zeros(batch, length, dtype=torch.long,
                                                                         device=inputs_embeds.device)
        decode = None
        if layers is not None:
            for layer in layers:
                check_usable(layer)
            reason = self._cannot_decode()
            if reason is None:
                decode = DecodeCache(length=past, layers=[layer.state for layer in layers])
                if real is not None or is_ragged(layers[0].state):
                    positions = None  # a padded batch: each row counts its own real tokens (ragged.py)
            elif past:
                raise ValueError(f"cached generation cannot continue exactly: {reason}; pass use_cache=False")
            else:
                for layer in layers:  # this pass is exact; a continuation from it would not be
                    layer.unusable = reason
        mask = None if real is None else real[:, past:]
        result = self.model.backbone(backbone_tokens, mask=mask, positions=positions,
                                     inputs_embeds=inputs_embeds, cache=decode)
        if layers is not None:
            for layer in layers:
                layer.length = past + length
        hidden = result.hidden if not logits_to_keep else result.hidden[:, -logits_to_keep:]
        logits = self.model.lm_head(hidden)
        loss = None
        if labels is not None:
            task_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                        ignore_index=IGNORE_INDEX)
            loss = task_loss + result.aux_loss
        return RouteformerCausalLMOutput(loss=loss, logits=logits, aux_loss=result.aux_loss,
                                         **{CACHE_FIELD: past_key_values})

    def _cannot_decode(self) -> str | None:
        backbone = self.model.backbone
        if not backbone.supports_cache():
            names = sorted({type(block.attention).__name__ for block in backbone.blocks
                            if not block.attention.supports_cache})
            return f"layers {names} have no cached decoding"
        if self.training:
            return "the cache was filled in training mode (aux losses and routing noise need the full pass)"
        return None

