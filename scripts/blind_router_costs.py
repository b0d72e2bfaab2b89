"""What topk with a position-blind router (compare --long's T = 4096 recall recipe) costs to train:
one thread, compare --long's model and recall batch at T = 4096 (B = 4, its last stage's). Prints the
training step of full, topk (recency router, the default) and topk (blind), ROUNDS alternating
rounds after a warm-up (default 5), with the quartiles of the per-round ratio to full;
then route_topk on the blind model's first-layer routing vectors as the layer routes them
(position_dim=False: by groups of equal keys since d3da98e, ops/topk/repeated.py; before, the
speculative kernel) and by the tiled kernel (True, newest first), and whether both select the
same keys.

    python scripts/blind_router_costs.py [ROUNDS]
"""
import statistics
import sys
import time

import torch

from routeformer.attention.topk import TopKAttention
from routeformer.bench.timing import ratio_quartiles, round_times
from routeformer.compare.budgets import LONG, options_for
from routeformer.ops.topk import route_topk
from routeformer.tasks import build_task
from routeformer.train.on_task import build_task_model

torch.set_num_threads(1)
LENGTH = 4096
task = build_task("mqar", seq_len=LENGTH, pairs=7, vocab_size=16)
BATCH = LONG.tasks["mqar"].stages[-1].schedule.batch_size
inputs, labels = task.batch(BATCH, torch.Generator().manual_seed(1), "train")
variants = {"full": ("full", {}), "topk": ("topk", {}), "topk_blind": ("topk", {"routing_positions": "none"})}
models = {}
for name, (mechanism, extra) in variants.items():
    torch.manual_seed(0)
    options = {**options_for(mechanism, LENGTH), **extra}
    models[name] = build_task_model(task, mechanism, options, LONG.spec).train()


def training_step(model) -> None:
    model.zero_grad(set_to_none=True)
    model(inputs, labels, logits_at_labels=True).total_loss.backward()


ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
steps = {name: lambda model=model: training_step(model) for name, model in models.items()}
times = round_times(steps, ROUNDS)
for name, values in times.items():
    low, median, high = ratio_quartiles(values, times["full"])
    print(f"training step, {name}: {1000 * statistics.median(values):.0f} ms; / full {median:.2f} "
          f"(quartiles {low:.2f}-{high:.2f}, {ROUNDS} rounds)")

captured = {}
layer = next(m for m in models["topk_blind"].modules() if isinstance(m, TopKAttention))
layer.router.register_forward_hook(lambda module, args, out: captured.setdefault("routing", out))
with torch.no_grad():
    models["topk_blind"](inputs, labels, logits_at_labels=True)
route_q, route_k = captured["routing"]
for position_dim in (False, True, False, True):
    start = time.perf_counter()
    route_topk(route_q, route_k, 64, position_dim=position_dim)
    print(f"route_topk, first layer, {'tiled (newest first)' if position_dim else 'as the layer routes'}: "
          f"{1000 * (time.perf_counter() - start):.0f} ms")
a, _, _ = route_topk(route_q, route_k, 64, position_dim=False)
b, _, _ = route_topk(route_q, route_k, 64, position_dim=True)
print("same selected sets:", torch.equal(a.sort(-1).values, b.sort(-1).values))
distinct = torch.unique(route_k[0, 0], dim=0).shape[0]
print(f"distinct routing keys in the first layer (batch 0, head 0): {distinct} of {LENGTH}")
