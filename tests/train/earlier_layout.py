"""Run directories of the earlier LM layout, which `eval`, `sample`, `export-hf`, `sparsify` and
`train.checkpoint.load_trained_model` still read: config.yaml beside rotating checkpoints
`checkpoint.pt`, `checkpoint.1.pt`, ... whose state is {step, model, config (a RunConfig's dict),
vocab}. Written here from a config's untrained models (nothing trains runs of that layout now)."""

from pathlib import Path

import torch
import yaml

from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.tasks import build_task
from routeformer.train.checkpoint import save_rotating
from tests.train.test_training import tiny_config


def earlier_lm_run(directory: Path, *overrides: str, steps: tuple[int, ...] = (2, 4)) -> Path:
    """`directory` as an earlier-layout LM run of the tiny test config (with `overrides`) with one
    checkpoint per entry of `steps`, the last the newest (checkpoint.pt); its tokeniser is task
    lm's for the config's corpus and length, so the run converts as that task's run."""
    config = tiny_config(directory, *overrides)
    vocab = build_task("lm", corpus=config.data.corpus, seq_len=config.data.seq_len).vocab
    config.model = ModelConfig.from_dict({**config.model.to_dict(), "vocab_size": len(vocab)})
    directory.mkdir(parents=True, exist_ok=True)
    for step in steps:
        torch.manual_seed(step)
        model = CausalLM(config.model)
        save_rotating(directory, {"step": step, "model": model.state_dict(), "config": config.to_dict(),
                                  "vocab": vocab.to_dict()}, keep=2)
    (directory / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return directory
