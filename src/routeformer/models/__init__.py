"""Transformer backbone, task heads and their config."""

from routeformer.models.config import ModelConfig
from routeformer.models.heads import IGNORE_INDEX, CausalLM, ModelOutput, SequenceClassifier, TokenPredictor
from routeformer.models.transformer import BackboneOutput, Transformer

__all__ = [
    "IGNORE_INDEX",
    "BackboneOutput",
    "CausalLM",
    "ModelConfig",
    "ModelOutput",
    "SequenceClassifier",
    "TokenPredictor",
    "Transformer",
]
