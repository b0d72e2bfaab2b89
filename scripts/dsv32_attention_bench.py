"""DeepSeek-V3.2 (transformers) forward with attn_implementation="routeformer" against "sdpa".

    PYTHONPATH=src python scripts/dsv32_attention_bench.py [--length 4096] [--index-topk 64] [--repeats 5]

A small model from a config (hidden 64, 2 layers, 4 heads, qk head dim 24 = 16 + 8 rotary, v head
dim 16, random weights, fp32, batch 1, one thread). With "sdpa" transformers turns the indexer's
selection into a boolean [B, 1, T, T] mask over dense attention; with "routeformer" the selected
indices go to routeformer's gathered-keys op. Both models share the weights; the two forwards
alternate in the same rounds (bench.timing.round_times) and the ratios are the medians of the
per-round ratios. "attention calls" is the time spent inside the registered attention functions
(sdpa's or routeformer's), summed over the layers of one forward. Logits are checked equal first.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import transformers
from transformers import AttentionInterface

from routeformer.bench.timing import machine_description, ratio_quartiles, round_times
from routeformer.integrations.hf import register


def model(implementation: str, length: int, index_topk: int) -> torch.nn.Module:
    config = transformers.DeepseekV32Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=index_topk, index_head_dim=16, index_n_heads=2,
        first_k_dense_replace=1, max_position_embeddings=length, attn_implementation=implementation)
    torch.manual_seed(0)
    return transformers.DeepseekV32ForCausalLM(config).eval()


def timed(function: Callable, spent: list[float]) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        spent.append(time.perf_counter() - start)
        return result

    return wrapper


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="tokens (default 4096)")
    parser.add_argument("--index-topk", type=int, default=64, help="keys per query (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds (default 5)")
    args = parser.parse_args(argv)
    for name in ("length", "index_topk", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    torch.set_num_threads(1)
    name = register()
    models = {implementation: model(implementation, args.length, args.index_topk)
              for implementation in ("sdpa", name)}
    ids = torch.randint(0, 1000, (1, args.length), generator=torch.Generator().manual_seed(0))
    spent: dict[str, list[float]] = {implementation: [] for implementation in models}
    mapping = AttentionInterface._global_mapping
    originals = {implementation: mapping[implementation] for implementation in models}
    for implementation in models:
        mapping[implementation] = timed(originals[implementation], spent[implementation])
    attention: dict[str, list[float]] = {implementation: [] for implementation in models}

    def forward(implementation: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            spent[implementation].clear()
            with torch.no_grad():
                logits = models[implementation](ids).logits
            attention[implementation].append(sum(spent[implementation]))
            return logits

        return run

    try:
        difference = (forward("sdpa")() - forward(name)()).abs().max().item()
        for values in attention.values():
            values.clear()
        times = round_times({implementation: forward(implementation) for implementation in models},
                            args.repeats, warmup=0)
    finally:
        mapping.update(originals)
    print(f"{machine_description()}; T = {args.length}, index_topk = {args.index_topk}, "
          f"{args.repeats} alternating rounds; max |logits difference| {difference:.2e}")
    print("| | sdpa s | routeformer s | speed-up (median of per-round ratios, quartiles) |")
    print("|---|---|---|---|")
    for label, series in (("forward", times), ("attention calls", attention)):
        low, median, high = ratio_quartiles(series["sdpa"], series[name])
        print(f"| {label} | {sorted(series['sdpa'])[len(series['sdpa']) // 2]:.3f} | "
              f"{sorted(series[name])[len(series[name]) // 2]:.3f} | {median:.1f}x ({low:.1f}-{high:.1f}) |")


if __name__ == "__main__":
    main()
