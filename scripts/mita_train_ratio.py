"""mita's training step against full's in compare --long's model (issue 44, part 3).

One thread; full and mita alternate in the same rounds (`bench.timing.round_times`, as
compare/long_costs.py does); the ratio is the median of the per-round ratios. MQAR, 7 pairs,
vocabulary 16; batch = 8192 tokens / T (16 at T = 512, as compare --long's last stage).

    PYTHONPATH=src python scripts/mita_train_ratio.py --lengths 512 1024 2048 4096 --repeats 5 \
        --options '{"block": 64, "landmarks": 16, "topk": 64}'
    (options default: compare/budgets.options_for("mita", T), i.e. T/8 of everything)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from routeformer.bench.timing import ratio_quartiles, round_times
from routeformer.compare.budgets import options_for
from routeformer.tasks import build_task
from routeformer.train.on_task import ModelSpec, build_task_model

SPEC = ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch (batch = tokens / T)")
    parser.add_argument("--options", default=None, help="mita options as JSON ({T} in values: T)")
    parser.add_argument("--mechanism", default="mita")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'T':>6} {'batch':>5} {'full ms':>9} {args.mechanism + ' ms':>9} {'ratio':>6}  (q1..q3)  options")
    for length in args.lengths:
        task = build_task("mqar", seq_len=length, pairs=7, vocab_size=16)
        options = options_for(args.mechanism, length) if args.options is None else \
            json.loads(args.options.replace("{T}", str(length)))
        models = {}
        for name, opts in (("full", {}), (args.mechanism, options)):
            torch.manual_seed(0)
            models[name] = build_task_model(task, name, opts, SPEC)
        batch = max(1, args.tokens // length)
        inputs, labels = task.batch(batch, torch.Generator().manual_seed(1), "train")

        def step(name):
            def run():
                model = models[name]
                model.train()
                model.zero_grad(set_to_none=True)
                model(inputs, labels, logits_at_labels=True).total_loss.backward()
            return run

        rounds = round_times({name: step(name) for name in models}, args.repeats, warmup=1)
        q1, ratio, q3 = ratio_quartiles(rounds[args.mechanism], rounds["full"])
        print(f"{length:>6} {batch:>5} {1000 * statistics.median(rounds['full']):>9.1f} "
              f"{1000 * statistics.median(rounds[args.mechanism]):>9.1f} {ratio:>6.2f}  "
              f"({q1:.2f}..{q3:.2f})  {json.dumps(options)}", flush=True)


if __name__ == "__main__":
    main()
