"""Toy training runs shared by the training tests."""

from tests.train.test_training import tiny_config


def quick_config(out_dir, *extra):
    """The tiny 12-step run of test_training, its final evaluation cut to 1024 characters (the whole
    validation split costs more than the training)."""
    return tiny_config(out_dir, "--final_eval_tokens", "1024", *extra)
