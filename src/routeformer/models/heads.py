"""Task heads on the Transformer backbone: CausalLM and SequenceClassifier."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.data.batches import IGNORE_INDEX
from routeformer.models.cache import DecodeCache, cached_description
from routeformer.models.config import ModelConfig
from routeformer.models.transformer import Transformer


@dataclass
class ModelOutput:
    logits: Tensor
    loss: Tensor | None  # the task loss alone
    aux_loss: Tensor  # the summed aux loss of the attention layers (already weighted)
    stats: list[dict[str, Tensor]] = field(default_factory=list)

    @property
    def total_loss(self) -> Tensor:
        """What to backpropagate: task loss + aux loss."""
        if self.loss is None:
            raise ValueError("no labels were given, so there is no task loss")
        return self.loss + self.aux_loss


def check_labels(labels: Tensor, shape: tuple[int, ...], allowed: str) -> None:
    """Raise TypeError unless `labels` is an integer tensor, ValueError unless its shape is `shape`."""
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        got = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(f"labels must be an integer tensor {allowed}; got {got}")
    if tuple(labels.shape) != shape:
        raise ValueError(f"labels must have shape {allowed} = {shape}; got {tuple(labels.shape)}")


class TokenPredictor(nn.Module):
    """A token at every position, from the backbone's hidden state there (tied embeddings by
    default). Causal: a next-token LM (`CausalLM` adds generation). Bidirectional: each position
    reads the whole sequence — tasks such as ListOps ask their question at one position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = Transformer(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.token_embedding.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    def forward(
        self, tokens: Tensor, labels: Tensor | None = None, *, mask: Tensor | None = None,
        positions: Tensor | None = None, logits_at_labels: bool = False, cache: DecodeCache | None = None,
        documents: Tensor | None = None,
    ) -> ModelOutput:
        """`labels[b, t]` is the target for position t (already shifted); -100 is ignored.
        `documents`: packed sequences (document ids [B, T], see Transformer.forward); the label of
        a document's last token (the next document's first) should be -100 so that the loss is the
        documents' own (data/documents.py's batches do so).
        `cache`: incremental decoding — `tokens` continue the stream the cache has seen
        (models/cache.py); the logits equal those rows of the parallel pass over the whole stream.

        `logits_at_labels=True` projects onto the vocabulary only where a label is set and returns
        those logits flattened [N, V] (in label order): tasks with sparse labels, such as
        associative recall, skip the largest matmul of the model elsewhere.
        """
        if labels is not None:
            check_labels(labels, tuple(tokens.shape), "[B, T], the shape of tokens")
        extra = {} if documents is None else {"documents": documents}
        result = self.backbone(tokens, mask=mask, positions=positions, cache=cache, **extra)
        if logits_at_labels:
            if labels is None:
                raise ValueError("logits_at_labels=True needs labels")
            selected = labels != IGNORE_INDEX
            logits = self.lm_head(result.hidden[selected])
            loss = F.cross_entropy(logits.float(), labels[selected]) if bool(selected.any()) else None
            return ModelOutput(logits, loss, result.aux_loss, result.stats)
        logits = self.lm_head(result.hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX
            )
        return ModelOutput(logits, loss, result.aux_loss, result.stats)


def left_aligned(tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of a padded batch with their real tokens moved to the right end, in order, and the
    pads before them: (tokens, mask) in left-padded layout."""
    order = mask.long().argsort(dim=1, stable=True)  # pads (0) first, real tokens (1) after, in order
    return tokens.gather(1, order), mask.gather(1, order)


class CausalLM(TokenPredictor):
    """Next-token language model with tied input/output embeddings."""

    def __init__(self, config: ModelConfig) -> None:
        if not config.causal:
            raise ValueError("CausalLM needs model.causal = True")
        super().__init__(config)

    @torch.no_grad()
    def generate(
        self, tokens: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
        top_k: int | None = None, generator: torch.Generator | None = None, use_cache: bool | None = None,
        mask: Tensor | None = None, output_logits: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Sample `max_new_tokens` tokens after `tokens` [B, T]; returns [B, T + max_new_tokens], and
        with `output_logits` also the fp32 logits each new token was sampled from [B, new, vocab].

        `mask` (bool [B, T], True = real token) lets the prompts be padded — left, right or
        anywhere: each row generates what its real tokens generate alone (new tokens are appended
        after the whole padded row and are all real).

        With a cache (`use_cache=True`, or None = whenever it can), the prompt is read once and each
        new token costs one step against the cached keys/values/state (every registered mechanism:
        models/cache.py; keys/values are allocated once for prompt + new tokens); a padded batch
        keeps one state per row (models/ragged.py). The cache keeps
        the whole stream (rotary positions keep counting past model.max_seq_len; learned positions
        cannot, so there the cache needs prompt + new tokens <= model.max_seq_len). Without a cache,
        the context, cropped to model.max_seq_len, is re-read at every step.
        """
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0; got {temperature!r}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be a positive integer or None; got {top_k!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0; got {max_new_tokens!r}")
        if mask is not None:
            if mask.shape != tokens.shape:
                raise ValueError(f"mask must have the prompt's shape {tuple(tokens.shape)}; "
                                 f"got {tuple(mask.shape)}")
            mask = mask.to(device=tokens.device, dtype=torch.bool)
            if not bool(mask.any(1).all()):
                raise ValueError("mask: every prompt needs at least one real token")
            if bool(mask.all()):
                mask = None
        fits = (self.config.positions != "learned"
                or tokens.shape[1] + max_new_tokens <= self.config.max_seq_len)
        can_cache = self.backbone.supports_cache() and fits
        if use_cache and not can_cache:
            raise ValueError("use_cache=True: " + (
                "learned positions stop at model.max_seq_len; the prompt plus max_new_tokens exceed it"
                if self.backbone.supports_cache() else
                f"some layers have no cached decoding (these mechanisms have: {cached_description()})"))
        use_cache = can_cache if use_cache is None else use_cache
        was_training = self.training
        self.eval()
        # The stream's length is known: each layer's keys/values are allocated once, never grown.
        cache = DecodeCache(reserve=tokens.shape[1] + max_new_tokens) if use_cache else None
        step_input, step_mask, step_logits = tokens, mask, []
        # Without a cache a padded context is re-read with its pads moved to the left, so that
        # windows over token indices (local, meta's window) reach real tokens only, as alone.
        context, real = (tokens, None) if mask is None else left_aligned(tokens, mask)
        for _ in range(max_new_tokens):
            if cache is not None:
                logits, rows_real = self(step_input, cache=cache, mask=step_mask).logits, step_mask
            elif real is None:
                logits, rows_real = self(context[:, -self.config.max_seq_len:]).logits, None
            else:
                window, rows_real = context[:, -self.config.max_seq_len:], real[:, -self.config.max_seq_len:]
                positions = (rows_real.long().cumsum(1) - 1).clamp_min(0)  # as each row alone
                logits = self(window, mask=rows_real, positions=positions).logits
                rows_real = None  # left-aligned: the last column is every row's last real token
            # The next token follows each row's last real token.
            row_logits = (logits[:, -1] if rows_real is None
                          else logits[torch.arange(len(logits)), rows_real.long().cumsum(1).argmax(1)])
            step_logits.append(row_logits.float())
            next_token = self._sample(row_logits.float(), temperature, top_k, generator)
            tokens = torch.cat([tokens, next_token], dim=1)
            context = torch.cat([context, next_token], dim=1)
            if real is not None:
                real = torch.cat([real, torch.ones_like(next_token, dtype=torch.bool)], dim=1)
            step_input, step_mask = next_token, None
        self.train(was_training)
        if output_logits:
            empty = tokens.new_zeros(tokens.shape[0], 0, self.config.vocab_size, dtype=torch.float32)
            return tokens, torch.stack(step_logits, dim=1) if step_logits else empty
        return tokens

    @staticmethod
    def _sample(logits: Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            threshold = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)


class SequenceClassifier(nn.Module):
    """Pools the backbone's hidden states ("mean" over real tokens, the first token "cls", or the
    last real token "last" — the one that has read everything in a causal model) and classifies."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.pooling == "cls" and config.causal:
            raise ValueError("pooling='cls' reads the first token, which a causal model lets see "
                             "nothing else; use pooling='last' or 'mean', or model.causal=False")
        self.config = config
        self.backbone = Transformer(config)
        self.classifier = nn.Linear(config.dim, config.num_classes)

    def forward(
        self, tokens: Tensor, labels: Tensor | None = None, *, mask: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> ModelOutput:
        if labels is not None:
            check_labels(labels, tuple(tokens.shape[:1]), "[B], one class per sequence")
        result = self.backbone(tokens, mask=mask, positions=positions)
        hidden = result.hidden
        real = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device) if mask is None else mask
        if self.config.pooling == "mean":
            weights = real.to(hidden.dtype)[..., None]
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        elif self.config.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            last = real.long().cumsum(1).argmax(1)  # index of the last real token
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        logits = self.classifier(pooled)
        loss = None if labels is None else F.cross_entropy(logits.float(), labels)
        return ModelOutput(logits, loss, result.aux_loss, result.stats)
