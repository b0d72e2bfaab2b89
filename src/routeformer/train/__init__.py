"""Training, evaluation and checkpoints."""

from routeformer.train.config import DataConfig, RunConfig, TrainConfig, load_config
from routeformer.train.evaluate import evaluate_lm
from routeformer.train.result import TrainResult


def train(config: RunConfig, *, resume: bool = True, quiet: bool = False) -> TrainResult:
    """Train the LM run `config` in `config.out_dir`: `routeformer train`, the task-lm run of the
    config (`runner.lm_config.train_lm_config`, which states the contract and what it raises)."""
    from routeformer.runner.lm_config import train_lm_config

    return train_lm_config(config, resume=resume, quiet=quiet)


__all__ = ["DataConfig", "RunConfig", "TrainConfig", "TrainResult", "evaluate_lm", "load_config", "train"]
