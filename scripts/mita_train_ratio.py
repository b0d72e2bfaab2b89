"""mita's training step against full's in compare --long's model (issue 44, part 3).

One thread; full and mita alternate in the same rounds (`bench.timing.round_times`, as
compare/long_costs.py does); the ratio is the median of the per-round ratios. MQAR, 7 pairs,
vocabulary 16; batch = 8192 tokens / T (16 at T = 512, as compare --long's last stage).

    PYTHONPATH=src python scripts/mita_train_ratio.py --lengths 512 1024 2048 4096 --repeats 5 \
        --options '{"block": 64, "landmarks": 16, "topk": 64}'
    (options default: compare/budgets.options_for("mita", T), i.e. T/8 of everything;
     --twin also times mita on its PyTorch query side, the path before the C kernel)
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


def twin(run):
    """`run` with mita's causal query side forced onto its PyTorch parts (the C kernel's twin)."""
    import routeformer.ops.mita.op as mita_op
    from routeformer.ops.backends import TORCH

    def run_twin():
        chosen = mita_op.mita_causal_backend
        mita_op.mita_causal_backend = lambda *args, **kwargs: (TORCH, "timing the twin")
        try:
            run()
        finally:
            mita_op.mita_causal_backend = chosen
    return run_twin


SPEC = ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch (batch = tokens / T)")
    parser.add_argument("--options", default=None, help="mita options as JSON ({T} in values: T)")
    parser.add_argument("--mechanism", default="mita")
    parser.add_argument("--twin", action="store_true",
                        help="also time mita with its causal query side on the PyTorch parts (the path "
                             "before the C kernel), in the same rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    twin_head = f" {'twin ms':>9} {'twin ratio':>10}" if args.twin else ""
    print(f"{'T':>6} {'batch':>5} {'full ms':>9} {args.mechanism + ' ms':>9} {'ratio':>6}  (q1..q3)"
          f"{twin_head}  options")
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

        def step(name, models=models, inputs=inputs, labels=labels):
            def run():
                model = models[name]
                model.train()
                model.zero_grad(set_to_none=True)
                model(inputs, labels, logits_at_labels=True).total_loss.backward()
            return run

        steps = {name: step(name) for name in models}
        if args.twin:
            steps["twin"] = twin(step(args.mechanism))
        rounds = round_times(steps, args.repeats, warmup=1)
        q1, ratio, q3 = ratio_quartiles(rounds[args.mechanism], rounds["full"])
        twin_cells = ""
        if args.twin:
            twin_cells = (f" {1000 * statistics.median(rounds['twin']):>9.1f} "
                          f"{ratio_quartiles(rounds['twin'], rounds['full'])[1]:>10.2f}")
        print(f"{length:>6} {batch:>5} {1000 * statistics.median(rounds['full']):>9.1f} "
              f"{1000 * statistics.median(rounds[args.mechanism]):>9.1f} {ratio:>6.2f}  "
              f"({q1:.2f}..{q3:.2f}){twin_cells}  {json.dumps(options)}", flush=True)


if __name__ == "__main__":
    main()
