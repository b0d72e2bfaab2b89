"""Stage 1 of compare --long's recall curriculum (T=32, 4 pairs, 600 steps) for one mechanism and
seed, with its recall recipe (meta: the full expert alone for the whole stage); prints validation
accuracy every 150 steps. A diagnostic of meta's seed failures (docs/results/routers.md).

With `--warmup-mixture` (meta only) it then evaluates the trained model twice: as compare does
(hard routing by the router, eval_eta) and with the warm-up mixture (the full expert alone).

    python scripts/stage1_probe.py MECHANISM SEED [--warmup-mixture]
        [--steps N --lr LR --warmup N --batch N]   (the stage's settings overridden, for the probes)
"""
import argparse

import torch

from routeformer.compare.budgets import LONG, layer_options
from routeformer.tasks import build_task
from routeformer.train.on_task import build_task_model, evaluate_on_task
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import TaskTrainConfig, train_task

parser = argparse.ArgumentParser()
parser.add_argument("mechanism")
parser.add_argument("seed", type=int)
parser.add_argument("--warmup-mixture", action="store_true")
parser.add_argument("--steps", type=int, help="override the stage's steps (meta's warm-up follows)")
parser.add_argument("--lr", type=float, help="override the stage's learning rate")
parser.add_argument("--warmup", type=int, help="override the stage's lr warm-up steps")
parser.add_argument("--batch", type=int, help="override the stage's batch size")
args = parser.parse_args()
torch.set_num_threads(1)
setup = LONG.tasks["mqar"]
stage = setup.stages[0]
task = build_task("mqar", **{**setup.options, **stage.options})
torch.manual_seed(args.seed)
schedule = stage.schedule
steps = args.steps or schedule.steps
options = layer_options(setup, args.mechanism, setup.seq_len)
if args.mechanism == "meta":
    options = {**options, "warmup_steps": steps}
model = build_task_model(task, args.mechanism, options, LONG.spec)
warmup = schedule.warmup_steps if args.warmup is None else args.warmup
cfg = TaskTrainConfig(Schedule(steps=steps, batch_size=args.batch or schedule.batch_size,
                               lr=args.lr or schedule.lr, warmup_steps=warmup),
                      seed=args.seed, eval_every=150)
history = train_task(model, lambda b, g: task.batch(b, g, "train"),
                     lambda m: evaluate_on_task(m, task, "validation", 256), cfg,
                     forward=lambda m, inputs, labels: m(inputs, labels, mask=task.mask(inputs),
                                                         logits_at_labels=True),
                     log=lambda line: None)
print(args.mechanism, args.seed, [round(e["accuracy"], 3) for e in history.evals], flush=True)
if args.warmup_mixture:
    routed = evaluate_on_task(model, task, "validation", 256)
    for layer in (m for m in model.modules() if hasattr(m, "warmup_mixture")):
        layer.in_warmup = lambda: True  # the warm-up mixture at evaluation too
        layer.eval_eta = None
    mixture = evaluate_on_task(model, task, "validation", 256)
    print(args.seed, "eval with the router (eval_eta):", round(routed["accuracy"], 3),
          "| eval with the warm-up mixture (full alone):", round(mixture["accuracy"], 3), flush=True)
