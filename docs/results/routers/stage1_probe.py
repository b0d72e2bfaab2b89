"""Stage 1 of compare --long's recall curriculum (T=32, 4 pairs, 600 steps) for one mechanism and
seed, with its recall recipe (meta: the full expert alone for the whole stage); prints validation
accuracy every 150 steps. A diagnostic of meta's seed failures (docs/results/routers.md).

    python docs/results/routers/stage1_probe.py MECHANISM SEED
"""
import sys

import torch

from routeformer.compare.long_budget import LONG
from routeformer.tasks import build_task
from routeformer.train.on_task import build_task_model, evaluate_on_task
from routeformer.train.task_loop import TaskTrainConfig, train_task

torch.set_num_threads(1)
mech, seed = sys.argv[1], int(sys.argv[2])
setup = LONG.tasks["mqar"]
stage = setup.stages[0]
task = build_task("mqar", **{**setup.options, **stage.options})
torch.manual_seed(seed)
model = build_task_model(task, mech, setup.options_for(mech), LONG.spec)
cfg = TaskTrainConfig(steps=stage.steps, batch_size=stage.batch_size, lr=stage.lr,
                      warmup_steps=stage.warmup_steps, seed=seed, eval_every=150)
h = train_task(model, lambda b, g: task.batch(b, g, "train"),
               lambda m: evaluate_on_task(m, task, "validation", 256), cfg,
               forward=lambda m, inputs, labels: m(inputs, labels, mask=task.mask(inputs),
                                                   logits_at_labels=True),
               log=lambda line: None)
print(mech, seed, [round(e["accuracy"], 3) for e in h.evals], flush=True)
