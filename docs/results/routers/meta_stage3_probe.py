"""meta on compare --long's T = 512 recall (mqar_512) for one seed, with the last stage's learning
rate (and warm-up) overridden: a diagnostic of the collapse at the T = 512 stage (seeds 3 and 4 of
docs/results/compare/long-routers-lr1e-3). Prints the validation accuracy per stage and the test
accuracy at T.

    python docs/results/routers/meta_stage3_probe.py SEED [--lr LR] [--warmup N] [--mechanism meta]
"""
import argparse
from dataclasses import replace

import torch

from routeformer.compare.long_budget import LONG
from routeformer.compare.long_jobs import long_jobs, train_long_job

parser = argparse.ArgumentParser()
parser.add_argument("seed", type=int)
parser.add_argument("--lr", type=float, help="the last stage's learning rate (default: the setup's)")
parser.add_argument("--warmup", type=int, help="the last stage's lr warm-up steps")
parser.add_argument("--mechanism", default="meta")
args = parser.parse_args()
torch.set_num_threads(1)
setup = LONG.tasks["mqar_512"]
last = setup.stages[-1].schedule
last = replace(last, lr=args.lr or last.lr,
               warmup_steps=last.warmup_steps if args.warmup is None else args.warmup)
setup = replace(setup, stages=(*setup.stages[:-1], replace(setup.stages[-1], schedule=last)))
job = next(j for j in long_jobs({"mqar_512": setup}, [args.mechanism], args.seed + 1, LONG.spec, "pydoc")
           if j.seed == args.seed)
result = train_long_job(job)
print(args.mechanism, args.seed, "last stage lr", last.lr, "warm-up", last.warmup_steps, "| validation:",
      [(v["stage"], round(v["accuracy"], 3)) for v in result["validation"]], "| test at T:",
      round(result["quality"], 4), flush=True)
