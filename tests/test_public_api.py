"""`import routeformer` gives what a user needs, each name documented, and the package is typed."""

import subprocess
import sys
from pathlib import Path

import torch

import routeformer

PUBLIC = {"build_attention", "list_attentions", "register_attention", "AttentionLayer", "AttentionOutput",
          "ModelConfig", "CausalLM", "SequenceClassifier", "TokenPredictor", "ViT", "build_task",
          "list_tasks", "Task", "train", "load_config", "RunConfig", "load_checkpoint", "load_trained_model",
          "sparsify", "convert_on_task", "Job", "TaskSetup", "ModelSpec", "Schedule", "run_in_directory",
          "load_spec", "load_run_model"}


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


def test_a_task_run_trains_resumes_and_loads_through_the_public_names(tmp_path):
    rf = routeformer
    setup = rf.TaskSetup({}, rf.Schedule(steps=2, batch_size=4, lr=1e-3, warmup_steps=1), evals=1,
                         validation_sequences=8, test_sequences=8)
    job = rf.Job("mqar-topk", "mqar", {"seq_len": 16, "pairs": 2, "vocab_size": 16}, "topk", {"topk": 4},
                 seed=0, setup=setup, spec=rf.ModelSpec(dim=16, depth=1, heads=2))
    record = rf.run_in_directory(tmp_path / "run", job)
    assert record["mechanism"] == "topk" and record["resumed"] == []
    assert rf.load_spec(tmp_path / "run") == job  # the run directory states its job
    assert rf.run_in_directory(tmp_path / "run", job)["test"] == record["test"]  # read back, not retrained
    run = rf.load_run_model(tmp_path / "run")
    assert run.step == 2 and run.task.describe() == record["task"]
