"""Training, evaluation and checkpoints."""

from routeformer.train.config import DataConfig, RunConfig, TrainConfig, load_config
from routeformer.train.evaluate import evaluate_lm
from routeformer.train.loop import TrainResult, train

__all__ = ["DataConfig", "RunConfig", "TrainConfig", "TrainResult", "evaluate_lm", "load_config", "train"]
