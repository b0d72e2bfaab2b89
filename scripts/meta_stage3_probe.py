"""meta on compare --long's T = 512 recall (mqar_512) for one seed, with the last stage's learning
rate (and warm-up) overridden: a diagnostic of the collapse at the T = 512 stage (seeds 3 and 4 of
compare/long-routers-lr1e-3 in docs/results/history.md; docs/results/routers.md). Prints the
validation accuracy per stage and the test accuracy at T.

    python scripts/meta_stage3_probe.py SEED [--lr LR] [--warmup N] [--mechanism meta]
"""
import argparse
from dataclasses import replace

import torch

from routeformer.compare.budgets import LONG
from routeformer.compare.run import compare_jobs
from routeformer.runner.jobs import train_job

parser = argparse.ArgumentParser()
parser.add_argument("seed", type=int)
parser.add_argument("--lr", type=float, help="the last stage's learning rate (default: the setup's)")
parser.add_argument("--warmup", type=int, help="the last stage's lr warm-up steps")
parser.add_argument("--mechanism", default="meta")
args = parser.parse_args()
torch.set_num_threads(1)
setup = LONG.tasks["mqar_512"]
last = setup.schedule  # the last stage's: on the task itself
last = replace(last, lr=args.lr or last.lr,
               warmup_steps=last.warmup_steps if args.warmup is None else args.warmup)
setup = replace(setup, schedule=last)
budget = replace(LONG, tasks={"mqar_512": setup}, seeds=args.seed + 1)
job = next(j for j in compare_jobs(["mqar_512"], [args.mechanism], budget, "pydoc") if j.seed == args.seed)
result = train_job(job)
print(args.mechanism, args.seed, "last stage lr", last.lr, "warm-up", last.warmup_steps, "| validation:",
      [(v["stage"], round(v["accuracy"], 3)) for v in result["validation"]], "| test at T:",
      round(result["quality"], 4), flush=True)
