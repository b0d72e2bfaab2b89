"""`import routeformer` gives what a user needs, each name documented, and the package is typed."""

import subprocess
import sys
from pathlib import Path

import torch

import routeformer

PUBLIC = {"build_attention", "list_attentions", "register_attention", "AttentionLayer", "AttentionOutput",
          "ModelConfig", "CausalLM", "SequenceClassifier", "TokenPredictor", "ViT", "build_task",
          "list_tasks", "Task", "train", "load_config", "RunConfig", "load_checkpoint", "load_trained_model",
          "sparsify", "convert_on_task"}


def test_the_public_names_are_exported_and_documented():
    assert PUBLIC | {"__version__"} == set(routeformer.__all__)
    for name in PUBLIC:
        doc = (getattr(routeformer, name).__doc__ or "").strip()
        # A dataclass without a docstring gets its signature as __doc__: that is not documentation.
        assert doc and not doc.startswith(f"{name}("), name


def test_the_quick_start_runs_on_the_public_names():
    layer = routeformer.build_attention("local", dim=32, heads=2, causal=True, window=4)
    x = torch.randn(2, 9, 32)
    output = layer(x)
    assert isinstance(output, routeformer.AttentionOutput) and output.out.shape == x.shape
    assert {"full", "meta", "topk"} <= set(routeformer.list_attentions())
    model = routeformer.CausalLM(routeformer.ModelConfig(vocab_size=20, dim=32, depth=2, heads=2,
                                                         attention=["local", "full"]))
    tokens = torch.randint(0, 20, (2, 9))
    assert model(tokens, tokens).loss.ndim == 0
    task = routeformer.build_task("mqar", seq_len=32, pairs=2, vocab_size=32)
    assert isinstance(task, routeformer.Task) and "mqar" in routeformer.list_tasks()


def test_the_package_is_marked_typed():
    package = Path(routeformer.__file__).parent
    assert (package / "py.typed").is_file()
    pyproject = (package.parents[1] / "pyproject.toml").read_text()
    assert '"py.typed"' in pyproject  # shipped as package data


def test_importing_routeformer_prints_nothing():
    finished = subprocess.run([sys.executable, "-c", "import routeformer"], capture_output=True, text=True,
                              timeout=120)
    assert finished.returncode == 0 and finished.stdout == "" and finished.stderr == "", finished.stderr
