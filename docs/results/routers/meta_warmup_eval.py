"""meta after stage 1 of the recall curriculum (T=32, 600 steps of the full-only warm-up): validation
accuracy evaluated as compare does (hard routing by the router, eval_eta) and with the warm-up
mixture (the full expert alone). A diagnostic for docs/results/routers.md.

    python docs/results/routers/meta_warmup_eval.py SEED
"""
import sys

import torch

from routeformer.compare.long_budget import LONG
from routeformer.tasks import build_task
from routeformer.train.on_task import build_task_model, evaluate_on_task
from routeformer.train.task_loop import TaskTrainConfig, train_task

torch.set_num_threads(1)
seed = int(sys.argv[1])
setup = LONG.tasks["mqar"]
stage = setup.stages[0]
task = build_task("mqar", **{**setup.options, **stage.options})
torch.manual_seed(seed)
model = build_task_model(task, "meta", setup.options_for("meta"), LONG.spec)
cfg = TaskTrainConfig(steps=stage.steps, batch_size=stage.batch_size, lr=stage.lr,
                      warmup_steps=stage.warmup_steps, seed=seed, eval_every=600)
h = train_task(model, lambda b, g: task.batch(b, g, "train"),
               lambda m: evaluate_on_task(m, task, "validation", 256), cfg,
               forward=lambda m, inputs, labels: m(inputs, labels, mask=task.mask(inputs),
                                                   logits_at_labels=True),
               log=lambda line: None)
routed = evaluate_on_task(model, task, "validation", 256)
layers = [m for m in model.modules() if hasattr(m, "warmup_mixture")]
for layer in layers:
    layer.in_warmup = lambda: True
    layer.eval_eta = None
mixture = evaluate_on_task(model, task, "validation", 256)
print(seed, "eval with the router (eval_eta):", round(routed["accuracy"], 3),
      "| eval with the warm-up mixture (full alone):", round(mixture["accuracy"], 3), flush=True)
