"""A probe of a recall curriculum for compare --long: train one mechanism through the given stages
and print validation accuracy (and wall time) every `--evals` of each stage. Used to choose the
T = 4096 recall setup on validation (docs/results/compare/long/README.md).

    python docs/results/compare/long/probes/recall_probe.py full 0 --vocab 80 --pairs 32 \
        --stage seq_len=32,pairs=4:600:64:3e-3:200 --stage seq_len=256:300:32:3e-3:30 ...

A stage is `task options:steps:batch:lr:warmup`; its options override the final task's
(`--seq-len`, `--pairs`, `--vocab`).
"""
import argparse
import time

import torch

from routeformer.compare.budgets import LONG
from routeformer.tasks import build_task
from routeformer.train.on_task import ModelSpec, build_task_model, evaluate_on_task
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import TaskTrainConfig, train_task


def parse_stage(text):
    options, steps, batch, lr, warmup = text.split(":")
    pairs = [item.split("=") for item in options.split(",") if item]
    return {k: int(v) for k, v in pairs}, int(steps), int(batch), float(lr), int(warmup)


parser = argparse.ArgumentParser()
parser.add_argument("mechanism")
parser.add_argument("seed", type=int)
parser.add_argument("--seq-len", type=int, default=4096)
parser.add_argument("--pairs", type=int, default=32)
parser.add_argument("--vocab", type=int, default=80)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--evals", type=int, default=3)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--stage", action="append", required=True, type=parse_stage)
parser.add_argument("--option", action="append", default=[], help="layer option key=value")
args = parser.parse_args()
torch.set_num_threads(1)
final = {"seq_len": args.seq_len, "pairs": args.pairs, "vocab_size": args.vocab}
task = build_task("mqar", **final)
spec = ModelSpec(**{**LONG.spec.__dict__, "dim": args.dim})


def parse_value(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


layer_options = {k: parse_value(v) for k, v in (o.split("=", 1) for o in args.option)}
torch.manual_seed(args.seed)
model = build_task_model(task, args.mechanism, layer_options, spec)
start = time.perf_counter()
for options, steps, batch, lr, warmup in args.stage:
    stage_task = build_task("mqar", **{**final, **options})
    cfg = TaskTrainConfig(Schedule(steps=steps, batch_size=batch, lr=lr, warmup_steps=warmup),
                          weight_decay=args.weight_decay, seed=args.seed,
                          eval_every=max(1, steps // args.evals))
    history = train_task(model, lambda b, g, t=stage_task: t.batch(b, g, "train"),
                         lambda m, t=stage_task: evaluate_on_task(
                             m, t, "validation", max(8, 64 * 512 // t.seq_len)), cfg,
                         forward=lambda m, inputs, labels, t=stage_task: m(
                             inputs, labels, mask=t.mask(inputs), logits_at_labels=True),
                         log=lambda line: None)
    print(f"{args.mechanism} seed {args.seed} {stage_task.describe()} steps={steps}: "
          f"{[round(e['accuracy'], 3) for e in history.evals]} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
