"""`routeformer bench generate`: tokens per second of `CausalLM.generate` with and without the
decoding cache, for the mechanisms that have one, after prompts of each context length.

Each generation samples `new_tokens` tokens (greedy) after a random prompt; the time covers the
whole call (reading the prompt once with the cache, or re-reading the growing context at every
step without it). Medians of alternating repetitions in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from routeformer.bench.timing import median_times
from routeformer.models.cache import CACHED_MECHANISMS
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM

# meta decodes incrementally only with a fixed position scale (see MetaAttention.decode).
GENERATE_OPTIONS = {"local": {"window": 256}, "meta": {"window": 256, "position_scale": 4096.0}}
HEADER = ("| mechanism | context | new tokens | cached tok/s | re-read tok/s | speedup | "
          "same greedy tokens |\n|---|---|---|---|---|---|---|")


def generation_model(mechanism: str, max_len: int, dim: int = 256, depth: int = 4) -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, dim=dim, depth=depth, heads=4, attention=mechanism,
                         attention_options={mechanism: GENERATE_OPTIONS.get(mechanism, {})},
                         max_seq_len=max_len, meta_token_id=1 if mechanism == "meta_tokens" else None)
    return CausalLM(config).eval()


def bench_generation(
    mechanisms: Sequence[str] = CACHED_MECHANISMS, contexts: Sequence[int] = (1024, 4096),
    new_tokens: int = 32, repeats: int = 3, progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    rows = []
    for context in contexts:
        prompt = torch.randint(2, 256, (1, context), generator=torch.Generator().manual_seed(0))
        prompt[0, ::10] = 1  # a meta-token every 10 positions (read only by meta_tokens)
        for mechanism in mechanisms:
            model = generation_model(mechanism, context + new_tokens)
            cached = model.generate(prompt, new_tokens, temperature=0, use_cache=True)
            reread = model.generate(prompt, new_tokens, temperature=0, use_cache=False)
            times = median_times({
                "cached": lambda m=model, p=prompt: m.generate(p, new_tokens, temperature=0, use_cache=True),
                "reread": lambda m=model, p=prompt: m.generate(p, new_tokens, temperature=0, use_cache=False),
            }, repeats, warmup=0)
            row = {"mechanism": mechanism, "context": context, "new_tokens": new_tokens,
                   "cached_tokens_per_s": new_tokens / times["cached"],
                   "reread_tokens_per_s": new_tokens / times["reread"],
                   "speedup": times["reread"] / times["cached"],
                   "same_tokens": bool(torch.equal(cached, reread))}
            rows.append(row)
            progress(format_row(row))
    return rows


def format_row(row: dict[str, Any]) -> str:
    return (f"| {row['mechanism']} | {row['context']} | {row['new_tokens']} | "
            f"{row['cached_tokens_per_s']:.1f} | {row['reread_tokens_per_s']:.1f} | {row['speedup']:.1f}x | "
            f"{'yes' if row['same_tokens'] else 'no'} |")
