"""The Transformer backbone: pre-norm blocks with the attention mechanism chosen per layer.

    h = h + Attention(LayerNorm(h));  h = h + MLP(LayerNorm(h))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from routeformer.attention import build_attention
from routeformer.attention.base import AttentionOutput
from routeformer.models.cache import DecodeCache, cached_description
from routeformer.models.config import ModelConfig
from routeformer.models.ragged import decode_rows, is_ragged, ragged_positions, start_ragged
from routeformer.ops.documents import check_documents, document_positions


@dataclass
class BackboneOutput:
    hidden: Tensor  # [B, T, D], after the final norm
    aux_loss: Tensor  # scalar: the sum of every layer's aux_loss
    stats: list[dict[str, Tensor]]  # one dict per layer


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(dim * ratio)
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, mechanism: str) -> None:
        super().__init__()
        options = dict(config.attention_options.get(mechanism, {}))
        if config.positions == "rotary":
            options.setdefault("rotary", True)
        self.attention_norm = nn.LayerNorm(config.dim)
        self.attention = build_attention(
            mechanism, dim=config.dim, heads=config.heads, causal=config.causal, **options
        )
        self.mlp_norm = nn.LayerNorm(config.dim)
        self.mlp = MLP(config.dim, config.mlp_ratio, config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, h: Tensor, mask: Tensor | None, positions: Tensor, meta_mask: Tensor | None = None,
                cache: dict | None = None, documents: Tensor | None = None):
        extra = {"meta_mask": meta_mask} if getattr(self.attention, "reads_meta_mask", False) else {}
        if documents is not None:
            extra["documents"] = documents
        if cache is not None and is_ragged(cache):  # a padded batch: each row decodes on its own state
            real = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if mask is None else mask
            out = decode_rows(self.attention, self.attention_norm(h), real, positions, cache, **extra)
            result = AttentionOutput(out, h.new_zeros(()), {})
        elif cache is not None:  # incremental decoding: the layer reads and extends its cache
            out = self.attention.decode(self.attention_norm(h), positions=positions, cache=cache, **extra)
            result = AttentionOutput(out, h.new_zeros(()), {})
        else:
            result = self.attention(self.attention_norm(h), mask=mask, positions=positions, **extra)
        h = h + self.dropout(result.out)
        h = h + self.mlp(self.mlp_norm(h))
        return h, result


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.dim)
        self.position_embedding = (
            nn.Embedding(config.max_seq_len, config.dim) if config.positions == "learned" else None
        )
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, name) for name in config.layer_attention())
        self.final_norm = nn.LayerNorm(config.dim)
        self.apply(init_weights)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """The token embeddings of `tokens`, an integer tensor [B, T] of ids in [0, vocab_size).
        Raises TypeError for another type or dtype, ValueError for another shape or, on CPU, an id
        outside the vocabulary (found by the embedding itself: no extra pass over the ids)."""
        if not isinstance(tokens, Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of integer ids [B, T]; "
                            f"got {type(tokens).__name__}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must hold integer ids (torch.long); got {tokens.dtype}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape [B, T]; got {tuple(tokens.shape)}")
        try:
            return self.token_embedding(tokens)
        except IndexError:
            vocab_size = self.config.vocab_size
            outside = tokens[(tokens < 0) | (tokens >= vocab_size)]
            raise ValueError(f"tokens must be ids in [0, vocab_size={vocab_size}); got "
                             f"{sorted(set(outside.tolist()))[:8]}") from None

    def forward(
        self, tokens: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None,
        inputs_embeds: Tensor | None = None, meta_mask: Tensor | None = None,
        cache: DecodeCache | None = None, documents: Tensor | None = None,
    ) -> BackboneOutput:
        """tokens long [B, T] (or `inputs_embeds` [B, T, D]) -> hidden states and aux loss.

        `meta_mask` [B, T] marks meta-tokens; by default, where tokens == config.meta_token_id.
        `cache`: incremental decoding (see models/cache.py): these T tokens follow the
        `cache.length` tokens already seen, and the hidden states equal the parallel pass's rows.
        With a cache, `mask` marks which of the T new tokens are real: a padded first call makes
        every row keep its own state (models/ragged.py), and each row then continues as it would
        alone; positions count each row's real tokens.
        `documents`: packed sequences, document ids [B, T] nondecreasing per row
        (ops/documents.py): no layer attends across documents and positions (default) restart at
        0 in each document, so every document's hidden states are those it gets alone.
        """
        h = self.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds
        batch, length, _ = h.shape
        offset = 0
        if documents is not None:
            if cache is not None:
                raise ValueError("documents: packed sequences are for training and prefill, "
                                 "not cached decoding")
            check_documents(documents, batch, length)
            if positions is None:
                positions = document_positions(documents)
        if cache is not None:
            mask = self.check_cache(cache, mask, batch, h.device)
            offset = cache.length
        if positions is None and cache is not None and is_ragged(cache.layers[0]):
            real = torch.ones(batch, length, dtype=torch.bool, device=h.device) if mask is None else mask
            positions = ragged_positions(cache.layers[0], real)
        if positions is None:
            positions = torch.arange(offset, offset + length, device=h.device).expand(batch, length)
        if meta_mask is None and self.config.meta_token_id is not None and inputs_embeds is None:
            meta_mask = tokens == self.config.meta_token_id
        zero_meta = meta_mask is not None and (
            self.config.zero_meta_positions_train if self.training else self.config.zero_meta_positions_eval)
        layer_positions = positions
        if zero_meta and self.config.positions == "rotary":
            layer_positions = positions.masked_fill(meta_mask, 0)  # angle 0: the identity rotation
        if self.position_embedding is not None:
            if length > self.config.max_seq_len or int(positions.max()) >= self.config.max_seq_len:
                raise ValueError(
                    f"learned positions go up to model.max_seq_len={self.config.max_seq_len}; "
                    f"got positions up to {int(positions.max())}"
                )
            position_embedding = self.position_embedding(positions)
            if zero_meta:
                position_embedding = position_embedding.masked_fill(meta_mask[..., None], 0.0)
            h = h + position_embedding
        h = self.dropout(h)
        aux_loss = h.new_zeros(())
        stats = []
        for index, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[index]
            h, result = block(h, mask, layer_positions, meta_mask, layer_cache, documents)
            aux_loss = aux_loss + result.aux_loss
            stats.append(result.stats)
        if cache is not None:
            cache.length += length
        return BackboneOutput(self.final_norm(h), aux_loss, stats)

    def supports_cache(self) -> bool:
        """Whether every layer can decode incrementally (CausalLM.generate's cached path)."""
        return all(block.attention.supports_cache for block in self.blocks)

    def check_cache(self, cache: DecodeCache, mask: Tensor | None, batch: int,
                    device: torch.device) -> Tensor | None:
        """Checks the cache (filling an empty one) and returns the padding mask to decode with:
        None when every token is real and the cache is shared by the batch."""
        if not self.supports_cache():
            missing = sorted({type(block.attention).__name__ for block in self.blocks
                              if not block.attention.supports_cache})
            raise ValueError(f"cache: layers {missing} have no cached decoding; the mechanisms with one are "
                             f"{cached_description()}")
        if not cache.layers:
            cache.layers.extend({} for _ in self.blocks)
        elif len(cache.layers) != len(self.blocks):
            raise ValueError(f"cache holds {len(cache.layers)} layers; this model has {len(self.blocks)}")
        if mask is not None:
            mask = mask.to(torch.bool)
            if bool(mask.all()):
                mask = None
        if mask is not None and not is_ragged(cache.layers[0]):
            if cache.length:
                raise ValueError("cache: padding after an unpadded start; pass the padding mask with the "
                                 "first (prompt) call, which gives every row its own state")
            for state in cache.layers:
                start_ragged(state, batch, device)
        if cache.reserve and not cache.length:  # the stream length generate announces (ops/decode)
            for state in cache.layers:
                for target in state["rows"] if is_ragged(state) else [state]:
                    target.setdefault("reserve", cache.reserve)
        return mask


def init_weights(module: nn.Module) -> None:
    # GPT-2 style: small normal weights, zero biases.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
