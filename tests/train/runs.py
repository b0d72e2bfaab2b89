"""Toy training runs shared by the training tests."""

from routeformer.tasks.mqar import MQAR
from tests.train.test_training import tiny_config

# `routeformer train --task mqar` runs of a few steps: the default backbone, and a narrower one
MQAR_RUN = ["train", "--task", "mqar", "--steps", "6", "--evals", "3", "--batch-size", "16", "--seed", "1"]
SMALL_MQAR_RUN = ["train", "--task", "mqar", "--steps", "3", "--evals", "3", "--batch-size", "8",
                  "--seed", "1", "--model.dim", "16", "--model.depth", "1", "--model.heads", "2"]


def quick_config(out_dir, *extra):
    """The tiny 12-step run of test_training, its final evaluation cut to 1024 characters (the whole
    validation split costs more than the training)."""
    return tiny_config(out_dir, "--final_eval_tokens", "1024", *extra)


def count_train_batches(monkeypatch, interrupt_at: int | None = None) -> list[int]:
    """Count the training batches MQAR draws (their sizes, in order); raise KeyboardInterrupt at the
    `interrupt_at`-th (None: never)."""
    calls, batch = [], MQAR.batch

    def counted(self, batch_size, generator, split="train"):
        if split == "train":
            calls.append(batch_size)
            if len(calls) == interrupt_at:
                raise KeyboardInterrupt
        return batch(self, batch_size, generator, split)

    monkeypatch.setattr(MQAR, "batch", counted)
    return calls


def hide_tensorboard(monkeypatch) -> None:
    """Make `import tensorboard` (and torch.utils.tensorboard) fail, as where it is not installed."""
    import builtins

    real_import = builtins.__import__

    def without_tensorboard(name, *args, **kwargs):
        if name.startswith(("torch.utils.tensorboard", "tensorboard")):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
