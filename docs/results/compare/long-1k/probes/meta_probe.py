"""Probe: meta on compare --long's MQAR curriculum with chosen options; prints validation accuracy
per eval and, at T=512 in eval mode, each meta layer's flops_vs_full / rows_* / hard_fraction.

PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/compare/long-1k/probes/meta_probe.py SEED [SCALE] [JSON_OPTIONS]
SCALE (default 1.0) multiplies every stage's steps (1.0 = the real curriculum). Test evaluation at
T/2T/4T is cut to 8192 tokens (the probe reads validation only)."""

import dataclasses
import json
import sys

import torch

from routeformer.attention.meta import MetaAttention
from routeformer.compare.budgets import LONG, task_options
from routeformer.runner.jobs import Job, train_job

torch.set_num_threads(1)
seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
scale = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
setup = LONG.tasks["mqar"]


def scaled(schedule):
    return dataclasses.replace(schedule, steps=max(1, int(schedule.steps * scale)),
                               warmup_steps=max(1, int(schedule.warmup_steps * scale)))


setup = dataclasses.replace(
    setup, schedule=scaled(setup.schedule), test_sequences=max(1, 8192 // setup.seq_len),
    curriculum=tuple(dataclasses.replace(s, schedule=scaled(s.schedule)) for s in setup.curriculum))
built = task_options("mqar", "meta", setup)
job = Job(f"probe-meta-seed{seed}", "mqar", built, "meta", options, seed, setup, LONG.spec)

captured = []
original = MetaAttention.forward


def forward(self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    if not self.training and args[0].shape[1] == setup.seq_len:
        captured.append({k: float(v) for k, v in result.stats.items()})
    return result


MetaAttention.forward = forward
result = train_job(job)
for record in result["validation"]:
    print(json.dumps({k: record[k] for k in record if k != "task"}))
keys = ("flops_vs_full", "rows_full", "rows_linear", "rows_local", "hard_fraction", "weight_full")
summary = {k: sum(c[k] for c in captured) / max(1, len(captured)) for k in keys}
print("options", json.dumps(options), "seed", seed, "scale", scale)
print("eval@T=512 meta stats (mean over layers and eval calls):", json.dumps(summary))
print("test quality T=512:", result["quality"], "train_seconds", round(result["train_seconds"]))
