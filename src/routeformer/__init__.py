"""routeformer: routed attention for PyTorch.

What a user imports, from one place (each name's docstring says what it does):

    import routeformer as rf

    layer = rf.build_attention("topk", dim=256, heads=4, causal=True, topk=32)   # one layer
    rf.list_attentions()                     # {mechanism name: its options and defaults}
    model = rf.CausalLM(rf.ModelConfig(vocab_size=256, attention=["local", "meta"], depth=2))
    task = rf.build_task("mqar", seq_len=64, pairs=4, vocab_size=64)              # rf.list_tasks()
    result = rf.train(rf.load_config(None, ["--steps", "100"]))     # an LM run, in its out_dir
    run = rf.load_run_model("runs/default")              # its model, task, config and tokeniser
    routed = rf.sparsify(dense_model, "topk", options={"topk": 64})             # dense -> routed
    job = rf.Job("mqar-topk", "mqar", {"seq_len": 64}, "topk", {}, seed=0,          # a task run's spec
                 setup=rf.TaskSetup({}, rf.Schedule(steps=600, batch_size=32, lr=3e-3, warmup_steps=60)),
                 spec=rf.ModelSpec(dim=64, depth=2))
    record = rf.run_in_directory("runs/mqar-topk", job)      # trained (or resumed) in a run directory
    job = rf.load_spec("runs/mqar-topk")                     # a run directory's spec, or a JSON/YAML file
    run = rf.load_run_model("runs/mqar-topk")                # its model, task, config and tokeniser

Everything else lives in the subpackages (routeformer.attention, .models, .tasks, .train, ...).
"""

from routeformer._startup import interrupt_as_one_line

with interrupt_as_one_line():  # Ctrl-C while the command starts: one line, not a traceback
    from routeformer.attention import (
        AttentionLayer,
        AttentionOutput,
        build_attention,
        list_attentions,
        register_attention,
    )
    from routeformer.models import CausalLM, ModelConfig, SequenceClassifier, TokenPredictor
    from routeformer.models.vit import ViT
    from routeformer.runner.jobs import Job, TaskSetup
    from routeformer.runner.run_dir import run_in_directory
    from routeformer.runner.spec import load_spec
    from routeformer.tasks import Task, build_task, list_tasks
    from routeformer.train import RunConfig, load_config, train
    from routeformer.train.checkpoint import load_checkpoint, load_run_model, load_trained_model
    from routeformer.train.on_task import ModelSpec
    from routeformer.train.schedule import Schedule
    from routeformer.train.sparsify import convert_on_task, sparsify

del interrupt_as_one_line

__version__ = "0.1.0"

__all__ = [
    "AttentionLayer",
    "AttentionOutput",
    "CausalLM",
    "Job",
    "ModelConfig",
    "ModelSpec",
    "RunConfig",
    "Schedule",
    "SequenceClassifier",
    "Task",
    "TaskSetup",
    "TokenPredictor",
    "ViT",
    "__version__",
    "build_attention",
    "build_task",
    "convert_on_task",
    "list_attentions",
    "list_tasks",
    "load_checkpoint",
    "load_config",
    "load_run_model",
    "load_spec",
    "load_trained_model",
    "register_attention",
    "run_in_directory",
    "sparsify",
    "train",
]
