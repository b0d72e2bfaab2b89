"""routeformer: routed attention for PyTorch.

What a user imports, from one place (each name's docstring says what it does):

    import routeformer as rf

    layer = rf.build_attention("topk", dim=256, heads=4, causal=True, topk=32)   # one layer
    rf.list_attentions()                     # {mechanism name: its options and defaults}
    model = rf.CausalLM(rf.ModelConfig(vocab_size=256, attention=["local", "meta"], depth=2))
    task = rf.build_task("mqar", seq_len=64, pairs=4, vocab_size=64)              # rf.list_tasks()
    rf.train(rf.load_config(None, ["--steps", "100"]))                         # the training loop
    model, tokenizer, config = rf.load_trained_model("runs/default")           # a trained run
    routed = rf.sparsify(dense_model, "topk", options={"topk": 64})             # dense -> routed

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
    from routeformer.tasks import Task, build_task, list_tasks
    from routeformer.train import RunConfig, load_config, train
    from routeformer.train.checkpoint import load_checkpoint, load_trained_model
    from routeformer.train.sparsify import convert_on_task, sparsify

del interrupt_as_one_line

__version__ = "0.1.0"

__all__ = [
    "AttentionLayer",
    "AttentionOutput",
    "CausalLM",
    "ModelConfig",
    "RunConfig",
    "SequenceClassifier",
    "Task",
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
    "load_trained_model",
    "register_attention",
    "sparsify",
    "train",
]
