"""ModelConfig: everything needed to rebuild a model, round-trippable through JSON/YAML."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from routeformer.ops._checks import check_positive

POSITION_KINDS = ("learned", "rotary", "none")
POOLING_KINDS = ("mean", "cls", "last")


@dataclass
class ModelConfig:
    """Everything that defines a model: sizes, the attention mechanism per layer and its options,
    positions, dropout; round-trips through JSON/YAML (`to_dict` / `from_dict`)."""

    vocab_size: int = 256
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    # One mechanism name for every layer, or one per layer (hybrid stacks: ["local", "full"]).
    attention: str | list[str] = "full"
    # Options per mechanism name, e.g. {"local": {"window": 64}}.
    attention_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    positions: str = "rotary"
    max_seq_len: int = 1024
    dropout: float = 0.0
    causal: bool = True
    tie_embeddings: bool = True
    # Meta-tokens (tasks/meta_tokens.py): the `_PAUSE_` id, whose positions the backbone hands to
    # layers that read them (meta_tokens); None = no meta-tokens. The zero_* switches drop the
    # positional encoding at meta positions (learned: no position embedding added; rotary: identity
    # rotation) in training and in evaluation, independently; flip them on a built model's config.
    meta_token_id: int | None = None
    zero_meta_positions_train: bool = False
    zero_meta_positions_eval: bool = False
    # Sequence classification head only.
    num_classes: int = 2
    pooling: str = "mean"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "depth", "heads", "max_seq_len", "num_classes"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.positions not in POSITION_KINDS:
            raise ValueError(f"model.positions must be one of {POSITION_KINDS}; got {self.positions!r}")
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"model.pooling must be one of {POOLING_KINDS}; got {self.pooling!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1); got {self.dropout!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"model.mlp_ratio must be > 0; got {self.mlp_ratio!r}")
        if self.meta_token_id is not None and not 0 <= self.meta_token_id < self.vocab_size:
            raise ValueError(f"model.meta_token_id must be in [0, vocab_size={self.vocab_size}) or None; "
                             f"got {self.meta_token_id!r}")
        if self.meta_token_id is None and (self.zero_meta_positions_train or self.zero_meta_positions_eval):
            raise ValueError("model.zero_meta_positions_train/eval need model.meta_token_id")
        for name in ("causal", "tie_embeddings", "zero_meta_positions_train", "zero_meta_positions_eval"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"model.{name} must be a bool (true or false); got {getattr(self, name)!r}")
        self.check_attention_options()
        layers = self.layer_attention()
        if len(layers) != self.depth:
            raise ValueError(
                f"model.attention lists {len(layers)} mechanisms but model.depth is {self.depth}"
            )

    def check_attention_options(self) -> None:
        """Raise ValueError unless `attention_options` maps registered mechanism names to dicts of
        that mechanism's options (`routeformer.list_attentions()`)."""
        from routeformer.attention.registry import list_attentions

        registered = list_attentions()
        if not isinstance(self.attention_options, dict):
            raise TypeError(f"model.attention_options must be a dict {{mechanism: {{option: value}}}}; "
                            f"got {type(self.attention_options).__name__}")
        for mechanism, options in self.attention_options.items():
            if mechanism not in registered:
                raise ValueError(f"model.attention_options has unknown mechanism {mechanism!r}; "
                                 f"registered: {sorted(registered)}")
            if not isinstance(options, dict):
                raise TypeError(f"model.attention_options[{mechanism!r}] must be a dict of options; "
                                f"got {type(options).__name__}")
            unknown = sorted(set(options) - set(registered[mechanism]))
            if unknown:
                raise ValueError(f"model.attention_options[{mechanism!r}] has unknown option(s) {unknown}; "
                                 f"valid options: {sorted(registered[mechanism])}")

    def layer_attention(self) -> list[str]:
        """The mechanism name of each layer."""
        if isinstance(self.attention, str):
            return [self.attention] * self.depth
        return list(self.attention)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**values)
