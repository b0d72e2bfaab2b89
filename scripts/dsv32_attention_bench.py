"""DeepSeek-V3.2 (transformers) forward with attn_implementation="routeformer", with and without the
blocked indexer (patch_indexer), against "sdpa".

    PYTHONPATH=src python scripts/dsv32_attention_bench.py [--length 4096] [--index-topk 64] [--repeats 5]

A small model from a config (hidden 64, 2 layers, 4 heads, qk head dim 24 = 16 + 8 rotary, v head
dim 16, random weights, fp32, batch 1, one thread). With "sdpa" transformers turns the indexer's
selection into a boolean [B, 1, T, T] mask over dense attention; with "routeformer" the selected
indices go to routeformer's gathered-keys op; "routeformer + blocked indexer" is that model with
`patch_indexer` (integrations/hf/indexer.py: the indexer scored in query blocks over each block's
causal prefix, the same indices). The models share the weights; the three forwards alternate in the
same rounds (bench.timing.round_times) and the ratios are the medians of the per-round ratios
against "sdpa". "attention calls" is the time spent inside the registered attention functions
(sdpa's or routeformer's), "indexer calls" inside the layers' indexers, each summed over the layers
of one forward. Logits are checked against "sdpa" first, and the blocked indexer's indices against
those of transformers' indexer in the "routeformer" model (the same attention, so every layer's
indexer sees the same input; "sdpa"'s later layers see hidden states that differ by rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from transformers import AttentionInterface

from routeformer.bench.timing import machine_description, ratio_quartiles, round_times
from routeformer.integrations.hf import patch_indexer, register

BLOCKED = "routeformer + blocked indexer"


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
    parser.add_argument("--block", type=int, default=128, help="queries per indexer block (default 128)")
    args = parser.parse_args(argv)
    for name in ("length", "index_topk", "repeats", "block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    torch.set_num_threads(1)
    name = register()
    implementations = {"sdpa": "sdpa", name: name, BLOCKED: name}  # label -> attn_implementation
    models = {label: model(implementation, args.length, args.index_topk)
              for label, implementation in implementations.items()}
    patch_indexer(models[BLOCKED], block=args.block)
    ids = torch.randint(0, 1000, (1, args.length), generator=torch.Generator().manual_seed(0))
    spent: dict[str, list[float]] = {implementation: [] for implementation in ("sdpa", name)}
    mapping = AttentionInterface._global_mapping
    originals = {implementation: mapping[implementation] for implementation in spent}
    for implementation in spent:
        mapping[implementation] = timed(originals[implementation], spent[implementation])
    indexer_spent: dict[str, list[float]] = {label: [] for label in models}
    indices: dict[str, list[torch.Tensor]] = {label: [] for label in models}
    for label, built in models.items():
        for module in built.modules():
            if hasattr(module, "index_topk"):
                module.forward = timed(module.forward, indexer_spent[label])
                module.register_forward_hook(lambda _, inputs, out, label=label: indices[label].append(out))
    attention: dict[str, list[float]] = {label: [] for label in models}
    indexer: dict[str, list[float]] = {label: [] for label in models}

    def forward(label: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            spent[implementations[label]].clear()
            indexer_spent[label].clear()
            indices[label].clear()
            with torch.no_grad():
                logits = models[label](ids).logits
            attention[label].append(sum(spent[implementations[label]]))
            indexer[label].append(sum(indexer_spent[label]))
            return logits

        return run

    try:
        reference = forward("sdpa")()
        difference = {label: (reference - forward(label)()).abs().max().item() for label in (name, BLOCKED)}
        same_indices = all(torch.equal(a, b) for a, b in zip(indices[name], indices[BLOCKED], strict=True))
        for series in (attention, indexer):
            for values in series.values():
                values.clear()
        times = round_times({label: forward(label) for label in models}, args.repeats, warmup=0)
    finally:
        mapping.update(originals)
    print(f"{machine_description()}; T = {args.length}, index_topk = {args.index_topk}, "
          f"block = {args.block}, {args.repeats} alternating rounds; max |logits difference| from sdpa: "
          f"routeformer {difference[name]:.2e}, {BLOCKED} {difference[BLOCKED]:.2e}; "
          f"blocked indexer's indices equal transformers' (in the routeformer model): {same_indices}")
    print(f"| | sdpa s | routeformer s | {BLOCKED} s | speed-up routeformer | speed-up {BLOCKED} |")
    print("|---|---|---|---|---|---|")
    for row, series in (("forward", times), ("attention calls", attention), ("indexer calls", indexer)):
        cells = [f"{statistics.median(series[label]):.3f}" for label in models]
        for label in (name, BLOCKED):
            low, median, high = ratio_quartiles(series["sdpa"], series[label])
            cells.append(f"{median:.1f}x ({low:.1f}-{high:.1f})")
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
