"""topk on one of compare --long's recall setups for one seed, with layer options overridden: a
diagnostic of topk at T = 4096 (compare/long-mqar-topk in docs/results/history.md: 0.40 ± 0.07,
routing recall falling from ~0.65 at T = 1024 to ~0.17 at 4096). Prints the validation accuracy per
stage and the test accuracy at T; the job is compare's own (same batches, same curriculum) apart from
the options.

    python scripts/topk_long_probe.py SEED [--task mqar] [--option NAME=VALUE ...]

VALUE is read as a Python literal (`distill_dense_steps=1000000000`, `routing_positions='none'`).
"""
import argparse
import ast
from dataclasses import replace

import torch

from routeformer.compare.budgets import LONG
from routeformer.compare.run import compare_jobs
from routeformer.runner.jobs import train_job

parser = argparse.ArgumentParser()
parser.add_argument("seed", type=int)
parser.add_argument("--task", default="mqar")
parser.add_argument("--mechanism", default="topk")
parser.add_argument("--option", action="append", default=[], help="NAME=VALUE, a layer option")
args = parser.parse_args()
torch.set_num_threads(1)
overrides = {}
for item in args.option:
    name, _, value = item.partition("=")
    overrides[name] = ast.literal_eval(value)
setup = LONG.tasks[args.task]
recipe = {**setup.mechanism_options.get(args.mechanism, {}), **overrides}
setup = replace(setup, mechanism_options={**setup.mechanism_options, args.mechanism: recipe})
budget = replace(LONG, tasks={args.task: setup}, seeds=args.seed + 1)
job = next(j for j in compare_jobs([args.task], [args.mechanism], budget, "pydoc") if j.seed == args.seed)
result = train_job(job)
print(args.mechanism, args.seed, overrides, "| validation:",
      [(v["stage"], round(v["accuracy"], 3)) for v in result["validation"]], "| test at T:",
      round(result["quality"], 4), flush=True)
