"""topk's sparse distillation scores, A/B in one process: the sampled rows' dense products and a
gather (topk_rows, the default) against per-slot key gathers (topk_gather, `DENSE_ROW_SCORES = 0`),
both against full, on compare --long's model and recall batch (8,192 tokens a step, one thread),
alternating rounds; prints each variant's median ms and its median per-round ratio to full.

    python docs/results/routers/ab_distill_scores.py [T] [ROUNDS]
"""
import statistics
import sys

import torch

from routeformer.attention import topk_distill
from routeformer.bench.timing import round_times
from routeformer.compare.budgets import options_for
from routeformer.compare.budgets import LONG
from routeformer.tasks import build_task
from routeformer.train.on_task import build_task_model

length = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 11
torch.set_num_threads(1)
task = build_task("mqar", seq_len=length, pairs=7, vocab_size=16)
inputs, labels = task.batch(8192 // length, torch.Generator().manual_seed(1), "train")
models = {}
for name in ("full", "topk"):
    torch.manual_seed(0)
    models[name] = build_task_model(task, name, options_for(name, length), LONG.spec).train()
default = topk_distill.DENSE_ROW_SCORES
variants = {"full": ("full", default), "topk_gather": ("topk", 0), "topk_rows": ("topk", default)}


def step(name: str, limit: int) -> None:
    topk_distill.DENSE_ROW_SCORES = limit
    model = models[name]
    model.zero_grad(set_to_none=True)
    model(inputs, labels, logits_at_labels=True).total_loss.backward()


times = round_times({variant: lambda variant=variant: step(*variants[variant]) for variant in variants},
                    rounds - 1, warmup=1)
topk_distill.DENSE_ROW_SCORES = default
for variant in variants:
    ratios = [a / b for a, b in zip(times[variant], times["full"], strict=True)]
    print(f"T={length} {variant}: {1000 * statistics.median(times[variant]):.1f} ms, "
          f"{statistics.median(ratios):.3f}x full")
