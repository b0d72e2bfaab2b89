"""Cached vs uncached `generate` in transformers models: tokens/s and peak memory.

    python -m routeformer.integrations.hf.bench [--prompt 256] [--new-tokens 64] [--repeats 5]

Models built from config (no downloads), random weights (speed does not depend on them): GPT-2
unpatched (transformers' own KV cache, the reference), GPT-2 patched with full / local / linear /
gated, and a `RouteformerForCausalLM` with local attention. For each, greedy generation of
`--new-tokens` tokens after a `--prompt`-token prompt, with the cache and without (re-reading the
context every step), timed in alternation (median of `--repeats` rounds, one thread), and the
extra peak resident memory of one call (bench/timing.py). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable

import torch
import transformers

from routeformer.bench.timing import machine_description, median_times, peak_memory_mib
from routeformer.integrations.hf.model import RouteformerConfig, RouteformerForCausalLM
from routeformer.integrations.hf.patch import patch_attention

VOCAB, DIM, DEPTH, HEADS = 1000, 256, 4, 4


def gpt2(max_len: int) -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=max_len, n_embd=DIM, n_layer=DEPTH,
                                     n_head=HEADS, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def models(max_len: int, window: int) -> dict[str, Callable[[], torch.nn.Module]]:
    def patched(mechanism: str, **options) -> Callable[[], torch.nn.Module]:
        return lambda: patch_attention(gpt2(max_len), mechanism, **options)

    def native() -> torch.nn.Module:
        torch.manual_seed(0)
        config = RouteformerConfig(vocab_size=VOCAB, dim=DIM, depth=DEPTH, heads=HEADS, attention="local",
                                   attention_options={"local": {"window": window}}, max_seq_len=max_len)
        return RouteformerForCausalLM(config).eval()

    return {"GPT-2 (transformers attention)": lambda: gpt2(max_len),
            "GPT-2 + full": patched("full"),
            f"GPT-2 + local (window {window})": patched("local", window=window),
            "GPT-2 + linear": patched("linear"), "GPT-2 + gated": patched("gated"),
            f"RouteformerForCausalLM local (window {window})": native}


def cache_state_mib(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
    """MiB of tensors the cache holds after cached generation of `new_tokens` after `ids`:
    transformers' keys/values for the unpatched model, routeformer's decode states otherwise."""
    with torch.no_grad():
        # attention_mask given: generate would otherwise take every token equal to pad_token_id as padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                             eos_token_id=None, return_dict_in_generate=True)
    total = 0
    for layer in out.past_key_values.layers:
        tensors = list(getattr(layer, "state", {}).values()) + [layer.keys, layer.values]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total / 2**20


def state_sizes(prompt_length: int, new_tokens: int, window: int) -> list[dict]:
    """The cache state of each model after cached generation (no timing: deterministic sizes)."""
    torch.set_num_threads(1)
    ids = torch.randint(0, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(0))
    return [{"model": name, "cache_state_mib": cache_state_mib(build(), ids, new_tokens)}
            for name, build in models(prompt_length + new_tokens, window).items()]


def bench(prompt_length: int, new_tokens: int, repeats: int, window: int,
          report: Callable[[dict], None] | None = None) -> list[dict]:
    torch.set_num_threads(1)
    ids = torch.randint(0, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, build in models(prompt_length + new_tokens, window).items():
        model = build()

        def run(use_cache: bool, model=model) -> torch.Tensor:
            with torch.no_grad():
                return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, use_cache=use_cache,
                                      attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)

        assert torch.equal(run(True), run(False)), name  # the two paths generate the same tokens
        times = median_times({"cache": lambda: run(True), "no cache": lambda: run(False)}, repeats)
        rows.append({"model": name, "cache_tokens_per_s": new_tokens / times["cache"],
                     "no_cache_tokens_per_s": new_tokens / times["no cache"],
                     "speedup": times["no cache"] / times["cache"],
                     "cache_peak_mib": peak_memory_mib(lambda: run(True)),
                     "no_cache_peak_mib": peak_memory_mib(lambda: run(False))})
        if report is not None:
            report(rows[-1])
    return rows


def table(rows: list[dict], settings: str) -> str:
    def mib(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    lines = [f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
             f"{machine_description()}. {settings}.", "",
             "| model | tokens/s, cache | tokens/s, no cache | cache speed-up | peak MiB, cache | "
             "peak MiB, no cache |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['cache_tokens_per_s']:.1f} | "
                     f"{row['no_cache_tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                     f"{mib(row['cache_peak_mib'])} | {mib(row['no_cache_peak_mib'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating timing rounds (default 5)")
    parser.add_argument("--window", type=int, default=64, help="local attention window (default 64)")
    parser.add_argument("--state-only", action="store_true",
                        help="only the MiB each cache holds after generation (no timing)")
    args = parser.parse_args(argv)
    for name in ("prompt", "new_tokens", "repeats", "window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.state_only:
        print(f"Cache state after a {args.prompt}-token prompt and {args.new_tokens} new tokens "
              f"(fp32, batch 1, dim {DIM}, depth {DEPTH}):\n\n| model | cache state MiB |\n|---|---|")
        for row in state_sizes(args.prompt, args.new_tokens, args.window):
            print(f"| {row['model']} | {row['cache_state_mib']:.2f} |")
        return
    rows = bench(args.prompt, args.new_tokens, args.repeats, args.window,
                 report=lambda row: print(f"measured: {row}", flush=True))
    print(table(rows, f"Batch 1, prompt {args.prompt}, {args.new_tokens} new tokens greedy, dim {DIM}, "
                      f"depth {DEPTH}, {HEADS} heads, vocab {VOCAB}, one thread; medians of {args.repeats} "
                      "alternating rounds; peak MiB = extra resident memory of one generate call"))


if __name__ == "__main__":
    main()
