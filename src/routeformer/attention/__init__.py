"""Attention layers [B, T, D] -> AttentionOutput, built by name from the registry."""

from routeformer.attention.base import AttentionLayer, AttentionOutput
from routeformer.attention.expanding import ExpandingAttention
from routeformer.attention.full import FullAttention
from routeformer.attention.gated import GatedAttention
from routeformer.attention.linear import LinearAttention
from routeformer.attention.local import LocalAttention
from routeformer.attention.meta import MetaAttention
from routeformer.attention.meta_tokens import MetaTokensAttention
from routeformer.attention.mita import MitaAttention
from routeformer.attention.multihop import MultihopAttention
from routeformer.attention.registry import (
    attention_class,
    attention_options,
    baseline_first,
    baseline_name,
    build_attention,
    list_attentions,
    register_attention,
    with_baseline,
)
from routeformer.attention.topk import TopKAttention

__all__ = [
    "AttentionLayer",
    "AttentionOutput",
    "ExpandingAttention",
    "FullAttention",
    "GatedAttention",
    "LinearAttention",
    "LocalAttention",
    "MetaAttention",
    "MetaTokensAttention",
    "MitaAttention",
    "MultihopAttention",
    "TopKAttention",
    "attention_class",
    "attention_options",
    "baseline_first",
    "baseline_name",
    "build_attention",
    "list_attentions",
    "register_attention",
    "with_baseline",
]
