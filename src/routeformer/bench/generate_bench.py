"""`routeformer bench generate`: tokens per second of `CausalLM.generate` with and without the
decoding cache, for the mechanisms that have one, after prompts of each context length.

Each generation samples `new_tokens` tokens (greedy) after a random prompt; the time covers the
whole call (reading the prompt once with the cache, or re-reading the growing context at every
step without it). Medians of alternating repetitions in one process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.attention import FullAttention, attention_class, baseline_first, baseline_name
from routeformer.bench.timing import median_times, round_times
from routeformer.models.cache import DecodeCache
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
                         max_seq_len=max_len, meta_token_id=_meta_token_id(mechanism))
    return CausalLM(config).eval()


def _meta_token_id(mechanism: str) -> int | None:
    """The prompts' meta-token (1, every 10th position) for a mechanism that reads injected ones."""
    return 1 if attention_class(mechanism).needs_meta_tokens else None


def bench_generation(
    mechanisms: Sequence[str] | None = None, contexts: Sequence[int] = (1024, 4096),
    new_tokens: int = 32, repeats: int = 3, progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    from routeformer.models.cache import CACHED_MECHANISMS

    mechanisms = CACHED_MECHANISMS if mechanisms is None else mechanisms
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


# -- cached greedy decoding, timed in alternating rounds ------------------------------------------
@dataclass
class CachedDecoder:
    """One model's greedy decoding with a cache: `prefill` reads a prompt into a fresh cache, each
    `step` feeds the last greedy token and keeps the next one.

    model: a causal LM whose forward takes `cache=` and returns `.logits` [B, t, vocab];
    cache: its DecodeCache; next: [B, 1] the token the next step reads; prefill_s: the prefill's
    wall-clock seconds."""

    model: nn.Module
    cache: DecodeCache
    next: Tensor
    prefill_s: float = 0.0

    @classmethod
    @torch.no_grad()
    def prefill(cls, model: nn.Module, prompt: Tensor, reserve: int = 0) -> CachedDecoder:
        """`model` reads `prompt` [B, T] into a new DecodeCache(reserve=reserve)."""
        cache = DecodeCache(reserve=reserve)
        started = time.perf_counter()
        logits = model(prompt, cache=cache).logits[:, -1]
        return cls(model, cache, logits.argmax(-1, keepdim=True), time.perf_counter() - started)

    @torch.no_grad()
    def step(self) -> None:
        logits = self.model(self.next, cache=self.cache).logits[:, -1]
        self.next = logits.argmax(-1, keepdim=True)


@torch.no_grad()
def decode_step_times(decoders: Mapping[Any, CachedDecoder], steps: int,
                      warmup: int = 0) -> dict[Any, list[float]]:
    """Wall-clock seconds of `steps` greedy cached decode steps of each decoder, one step of every
    decoder per round, the order reversed every other round (timing.round_times), so the machine's
    drift reaches all alike and the per-round ratios (timing.ratio_quartiles) cancel it.

    Args:
        decoders: name (any key) -> a CachedDecoder that has read a prompt [B, T]
            (`CachedDecoder.prefill`), in the order of a round; each advances by warmup + steps
            tokens, its cache growing to T + warmup + steps (reserve that many, and no step
            reallocates it).
        steps: timed rounds (>= 1); warmup: untimed rounds before them.

    Returns:
        name -> a list of `steps` positive floats, the seconds of that decoder's step in each
        timed round (round i's entries of two decoders were measured side by side)."""
    return round_times({name: decoder.step for name, decoder in decoders.items()}, steps, warmup=warmup)


# -- the decode benchmark: one prefill, then new tokens one step at a time ---------------------
# `routeformer bench generate`: per context, every mechanism's model reads the prompt once into
# its cache, then all of them decode `new_tokens` steps in alternating rounds (timing.round_times:
# one step of each per round, the order reversed every other round). tokens/s = 1 / median step.

DECODE_OPTIONS = {
    "local": {"window": 256},
    "meta": {"window": 256, "position_scale": 4096.0},
    "topk": {"topk": 64, "routing_dim": 16},
}
# full's decode before the copy-free cache (commit 66f52b3), run in the same process as the
# baseline the copy-free cache is compared with.
CONCATENATING = "full (cat cache, before)"
DECODE_HEADER = ("| mechanism | context | prefill s | decode tok/s | step vs full (quartiles) | state MiB | "
                 "peak MiB | read / step MiB |\n|---|---|---|---|---|---|---|---|")


def _append_by_concatenation(cache: dict, k, v, prefix: str = ""):
    """`ops.decode.append_keys_values` as it was before the copy-free cache: every step copies
    every cached key and value into a new tensor (O(L) per token)."""
    if prefix + "k" in cache:
        k = torch.cat([cache[prefix + "k"], k], dim=2)
        v = torch.cat([cache[prefix + "v"], v], dim=2)
    cache[prefix + "k"], cache[prefix + "v"] = k, v
    return k, v, cache.get(prefix + "start", 0)


def _softmax_before(q, k, v, query_start: int, key_start: int, window: int | None = None):
    """`ops.decode.cached_softmax_attention` as it was before (a [t, L] mask built and tested per step)."""
    import torch.nn.functional as F

    from routeformer.ops.decode import allowed_cached

    if window is None and query_start == key_start and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
    query_index = torch.arange(query_start, query_start + q.shape[2], device=q.device)
    key_index = torch.arange(key_start, key_start + k.shape[2], device=q.device)
    allowed = allowed_cached(query_index, key_index, window)
    if bool(allowed.all()):
        return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class _BeforeCopyFreeCache:
    """Within the block, `full` layers decode with the code they had before the copy-free cache."""

    def __enter__(self):
        import routeformer.attention.full as full

        self.saved = full.append_keys_values, full.cached_softmax_attention
        full.append_keys_values, full.cached_softmax_attention = _append_by_concatenation, _softmax_before

    def __exit__(self, *exc):
        import routeformer.attention.full as full

        full.append_keys_values, full.cached_softmax_attention = self.saved


class _ConcatenatingDecoder(CachedDecoder):
    """`full`'s decoder stepping with the code it had before the copy-free cache."""

    @classmethod
    def copy_of(cls, full: CachedDecoder) -> _ConcatenatingDecoder:
        """The same model and keys/values after the prefill, in that code's layout (one tensor per
        layer), so the prompt is read once for both."""
        layers = [{"k": state["k"].clone(), "v": state["v"].clone(), "length": state["length"]}
                  for state in full.cache.layers]
        cache = DecodeCache(length=full.cache.length, layers=layers)
        return cls(full.model, cache, full.next, full.prefill_s)

    def step(self) -> None:
        with _BeforeCopyFreeCache():
            super().step()


def decode_model(mechanism: str, max_len: int, dim: int, depth: int, heads: int,
                  options: dict) -> CausalLM:
    torch.manual_seed(0)
    name = FullAttention.attention_name if mechanism == CONCATENATING else mechanism
    config = ModelConfig(vocab_size=256, dim=dim, depth=depth, heads=heads, attention=name,
                         attention_options={name: options.get(name, {})}, max_seq_len=max_len,
                         meta_token_id=_meta_token_id(name))
    return CausalLM(config).eval()


@torch.no_grad()
def bench_decode(
    mechanisms: Sequence[str], contexts: Sequence[int], new_tokens: int = 64, *, dim: int = 256,
    depth: int = 1, heads: int = 4, options: dict | None = None, memory_steps: int = 4,
    before: bool = True, up_to: dict[str, int] | None = None, decode_threads: int | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Per context: every mechanism prefills the same random prompt into its cache, then all decode
    `new_tokens` greedy steps in alternating rounds; then each runs `memory_steps` more steps alone
    under the peak-memory probe. `before`: also run `full` with the code it had before the
    copy-free cache (CONCATENATING), as the same-process baseline for it: its model is full's and
    its cache starts as a copy of full's after the prefill (the same keys and values, in the
    layout that code kept: one tensor per layer), so the prompt is read once for both.
    `up_to`: mechanism -> longest context it runs at (a quadratic prefill at 64k on 2 cores takes
    minutes). `decode_threads`: torch threads for the decode steps (the prefill keeps the process's):
    a one-token step's ops are too small to split, and on a shared machine two OpenMP threads wait
    on each other's barriers (measured on the loaded 2-core machine: a 1-layer full step at 600
    keys 100-220 ms with 2 threads, 2.2-2.8 ms with 1)."""
    from routeformer.bench.timing import peak_memory_mib, ratio_quartiles
    from routeformer.ops.decode import state_bytes

    options = {**DECODE_OPTIONS, **(options or {})}
    names, baseline = list(mechanisms), baseline_name()
    if before and FullAttention.attention_name in names:
        names.insert(names.index(FullAttention.attention_name) + 1, CONCATENATING)
    rows = []
    for context in contexts:
        prompt = torch.randint(2, 256, (1, context), generator=torch.Generator().manual_seed(0))
        prompt[0, ::10] = 1  # a meta-token every 10 positions (read only by meta_tokens)
        runs: dict[str, CachedDecoder] = {}
        here = [name for name in names if context <= (up_to or {}).get(name, context)]
        reserve = context + new_tokens + memory_steps + 1
        for name in here:
            if name == CONCATENATING:
                runs[name] = _ConcatenatingDecoder.copy_of(runs[FullAttention.attention_name])
                continue
            model = decode_model(name, reserve, dim, depth, heads, options)
            runs[name] = CachedDecoder.prefill(model, prompt, reserve)

        threads = torch.get_num_threads()
        torch.set_num_threads(decode_threads or threads)
        times = decode_step_times(runs, new_tokens)
        for name in here:
            run = runs[name]
            layers = run.model.backbone.blocks
            state = state_bytes(run.cache.layers)
            read, exact = 0, True
            for block, layer_cache in zip(layers, run.cache.layers, strict=True):
                layer_read, layer_exact = block.attention.decode_read_bytes(layer_cache)
                read, exact = read + layer_read, exact and layer_exact
            extra = peak_memory_mib(lambda run=run: [run.step() for _ in range(memory_steps)])
            median = statistics.median(times[name])
            low, mid, high = (ratio_quartiles(times[name], times[baseline]) if baseline in times
                              else (1, 1, 1))
            row = {"mechanism": name, "context": context, "new_tokens": new_tokens,
                   "prefill_s": run.prefill_s, "step_s": median, "tokens_per_s": 1.0 / median,
                   "step_vs_full": [low, mid, high], "state_mib": state / 2**20,
                   "peak_mib": None if extra is None else state / 2**20 + extra,
                   "read_mib": read / 2**20, "read_exact": exact}
            rows.append(row)
            progress(format_decode_row(row))
        torch.set_num_threads(threads)
        runs.clear()
    return rows


def format_decode_row(row: dict[str, Any]) -> str:
    low, mid, high = row["step_vs_full"]
    peak = "n/a" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
    read = f"{row['read_mib']:.2f}" if row["read_exact"] else f"≤ {row['read_mib']:.2f}"
    return (f"| {row['mechanism']} | {row['context']} | {row['prefill_s']:.1f} | {row['tokens_per_s']:.1f} | "
            f"{mid:.3f} ({low:.3f}-{high:.3f}) | {row['state_mib']:.1f} | {peak} | {read} |")


def command_generate(args) -> int:
    """`routeformer bench generate`: the decode benchmark (or, with --reread, generation with and
    without the cache at short contexts). Writes docs when --output is given."""
    import json
    import os
    from pathlib import Path

    from routeformer.bench.tables_and_plots import provenance
    from routeformer.models.cache import CACHED_MECHANISMS

    if args.reread:
        print(HEADER, flush=True)
        rows = bench_generation(args.mechanisms, contexts=args.lengths, new_tokens=args.new_tokens,
                                repeats=args.repeats, progress=lambda line: print(line, flush=True))
        lines = [HEADER, *[format_row(row) for row in rows]]
        summary = ("CausalLM with D=256, 4 layers, 4 heads, vocabulary 256, untrained; B=1; greedy "
                   f"decoding of {args.new_tokens} tokens after a random prompt; tokens/s = new tokens / "
                   "the whole generate call (prompt included), medians of "
                   f"{args.repeats} alternating repetitions.")
    else:
        unknown = sorted(set(args.mechanisms or ()) - set(CACHED_MECHANISMS))
        if unknown:
            raise ValueError(f"--mechanisms: {unknown} have no cached decoding; those with one: "
                             f"{list(CACHED_MECHANISMS)}")
        mechanisms = baseline_first(args.mechanisms or CACHED_MECHANISMS)
        options = {"local": {"window": args.window},
                   "topk": {"topk": args.topk, "routing_dim": args.routing_dim}}
        print(DECODE_HEADER, flush=True)
        up_to = {}
        for item in args.up_to or ():
            name, _, length = item.partition("=")
            if name not in CACHED_MECHANISMS or not length.isdigit():
                raise ValueError(f"--up-to: expected MECHANISM=LENGTH with a cached mechanism; got {item!r}")
            up_to[name] = int(length)
        rows = bench_decode(mechanisms, args.lengths, args.new_tokens, dim=args.dim, depth=args.depth,
                            heads=args.heads, options=options, up_to=up_to,
                            decode_threads=args.decode_threads,
                            progress=lambda line: print(line, flush=True))
        lines = [DECODE_HEADER, *[format_decode_row(row) for row in rows]]
        load = " ".join(f"{value:.2f}" for value in os.getloadavg())
        summary = (f"Prefill with {torch.get_num_threads()} threads, decode steps with "
                   f"{args.decode_threads}. "
                   f"CausalLM with D={args.dim}, {args.depth} layer(s), {args.heads} heads, rotary "
                   "positions, vocabulary 256, untrained, fp32; B=1; per context one random prompt is "
                   f"prefilled once per mechanism, then {args.new_tokens} greedy single-token steps run in "
                   "alternating rounds "
                   "(one step of every mechanism per round, order reversed every other round). decode tok/s "
                   "= 1 / median step; step vs full = quartiles of the per-round ratio step time / full's; "
                   "state = bytes allocated by the cache's tensors (each buffer once); peak = state + the "
                   "extra resident memory 4 further steps needed (VmHWM probe); read / step = the cached "
                   "bytes one step reads (≤: an upper bound, the live state). "
                   f"`{CONCATENATING}`: full with the decode code it had before the copy-free cache "
                   "(torch.cat per step), in the same process. Options: local window "
                   f"{args.window}; topk K={args.topk}, r={args.routing_dim} (recency router, distill); meta "
                   f"window 256, position_scale 4096; meta_tokens with a meta-token every 10 positions. "
                   f"Load average at the end (1, 5, 15 min): {load}.")
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        command = (f"routeformer bench generate --lengths {' '.join(map(str, args.lengths))} "
                   f"--new-tokens {args.new_tokens}"
                   + (f" --repeats {args.repeats} --reread" if args.reread else
                      f" --dim {args.dim} --depth {args.depth} --heads {args.heads}"
                      f" --decode-threads {args.decode_threads}"
                      + (f" --up-to {' '.join(args.up_to)}" if args.up_to else ""))
                   + (f" --mechanisms {' '.join(args.mechanisms)}" if args.mechanisms else ""))
        title = ("# Generation with and without the decoding cache" if args.reread else
                 "# Cached decoding: tokens/s, memory and bytes read per step")
        output.write_text("\n".join([title, "", provenance(command) + " " + summary, "", *lines, ""]))
        output.with_suffix(".json").write_text(json.dumps({"rows": rows}, indent=2))
        print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0


@torch.no_grad()
def bench_across_contexts(
    mechanism: str, contexts: Sequence[int], new_tokens: int = 64, *, dim: int = 256, depth: int = 1,
    heads: int = 4, options: dict | None = None, decode_threads: int | None = 1,
) -> dict[int, float]:
    """Median decode step (s) of one mechanism after prompts of each context, the steps of all
    contexts in alternating rounds in one process: whether its step depends on the context, with
    the machine's drift shared by every context (no other mechanism's steps in between)."""
    options = {**DECODE_OPTIONS, **(options or {})}
    runs = {}
    for context in contexts:
        prompt = torch.randint(2, 256, (1, context), generator=torch.Generator().manual_seed(0))
        model = decode_model(mechanism, context + new_tokens + 1, dim, depth, heads, options)
        runs[context] = CachedDecoder.prefill(model, prompt, context + new_tokens + 1)

    threads = torch.get_num_threads()
    torch.set_num_threads(decode_threads or threads)
    try:
        times = decode_step_times(runs, new_tokens)
    finally:
        torch.set_num_threads(threads)
    return {context: statistics.median(values) for context, values in times.items()}
