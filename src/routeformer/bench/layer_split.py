"""`routeformer bench layers --split`: where a routed layer's training step goes, part by part.

One training step of a causal layer (forward in train mode, then backward into the input and the
weights, as `layer_calls.layer_forward_backward`) is run under torch.profiler, and its wall time is
split into:

- `projections`: the layer's `*_proj` linear children (Q/K/V and output projections), timed by
  forward hooks that open a profiler range (every mechanism has them);
- `routing`: the layer's `router` child (topk, meta) and whatever the code marks
  `routeformer::routing` (MiTA: landmark pooling, the landmark stage — scores, top-K key selection
  and the shared expert's values, computed in one pass — and each query's expert choice);
- `attention`: code marked `routeformer::attention` (`AttentionLayer.attend` of every layer that
  uses the base forward; MiTA's op), less the routing inside it;
- `aux_loss`: code marked `routeformer::aux_loss` (none of the layers marks it yet: a mechanism's
  auxiliary loss then counts under `other` or inside the part that computes it);
- `other`: the rest of the step (input checks, reshapes, stats, unmarked work): the step's wall
  time less the parts above and below;
- `backward`: what the backward pass spends outside the parts' nodes (the autograd engine's own
  work, and the gradients' accumulation).

Each part counts its forward time (its ranges, less nested ranges of other parts) and its backward
time: autograd evaluates one node per differentiable forward op, and the profiler gives the node
and the op one sequence number, so each node's time goes to the part whose range held its op.
The parts of one step therefore sum to its wall time; the table gives each part's median over
the repetitions (and the
median total, which the medians sum to within noise). The profiler adds a little overhead per op:
compare totals with `bench layers` (no profiler) for absolute times. `bench_split` runs on one
thread (as compare --long times a training step; on a shared 2-core machine two OpenMP threads can
wait on each other for most of a step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

PARTS = ("projections", "routing", "attention", "aux_loss", "backward", "other")
_RANGE = "routeformer::"  # prefix of the ranges this split reads (routeformer::routing, ...)
_MARKED = {f"{_RANGE}{part}": part for part in PARTS if part != "other"}


def _hook_ranges(layer: nn.Module) -> list[Any]:
    """Forward hooks that open a profiler range around the layer's projections and router."""
    handles = []
    for name, child in layer.named_children():
        if name.endswith("_proj") and isinstance(child, nn.Linear):
            part = "projections"
        elif name == "router":
            part = "routing"
        else:
            continue
        opened: list[Any] = []

        def pre(module, inputs, part=part, opened=opened):
            scope = torch.profiler.record_function(f"{_RANGE}{part}")
            scope.__enter__()
            opened.append(scope)

        def post(module, inputs, output, opened=opened):
            opened.pop().__exit__(None, None, None)

        handles += [child.register_forward_pre_hook(pre), child.register_forward_hook(post)]
    return handles


_BACKWARD_NODE = "autograd::engine::evaluate_function: "


def _innermost(ranges: list[tuple[float, float, str]], moment: float) -> str | None:
    """The part of the innermost marked range (start, end, part) holding `moment` (None: none)."""
    inside = [(start, end, part) for start, end, part in ranges if start <= moment < end]
    return max(inside, key=lambda item: (item[0], -item[1]))[2] if inside else None


def _exclusive_parts(events, total_us: float) -> dict[str, float]:
    """Microseconds per part of one step from the profiler's events.

    Forward: each marked range's duration less the marked ranges directly inside it (a part's own
    time). Backward: autograd evaluates one node per differentiable forward op, and the profiler
    gives node and op the same sequence number, so each node's time goes to the part whose range
    held its forward op (`other` where none did); `backward` keeps what no node claims (the
    engine's own work). `other` = total − every other part, so the parts sum to `total_us`."""
    events = list(events)
    ranges = sorted(((e.time_range.start, e.time_range.end, _MARKED[e.name]) for e in events
                     if e.name in _MARKED), key=lambda item: (item[0], -item[1]))
    parts = dict.fromkeys(PARTS, 0.0)
    stack: list[list[Any]] = []  # [end, part, duration of marked children, start]

    def close(entry):
        end, part, children, start = entry
        parts[part] += (end - start) - children

    for start, end, part in ranges:
        while stack and stack[-1][0] <= start:
            close(stack.pop())
        if stack:
            stack[-1][2] += end - start
        stack.append([end, part, 0.0, start])
    while stack:
        close(stack.pop())

    forward_ranges = [r for r in ranges if r[2] != "backward"]
    backward_ranges = [r for r in ranges if r[2] == "backward"]
    part_of_sequence: dict[int, str] = {}
    for e in events:
        sequence = getattr(e, "sequence_nr", -1)
        if sequence < 0 or e.name.startswith(_BACKWARD_NODE) or e.name in _MARKED:
            continue
        if _innermost(backward_ranges, e.time_range.start) is None:  # an op of the forward pass
            part_of_sequence.setdefault(sequence, _innermost(forward_ranges, e.time_range.start) or "other")
    for e in events:
        if e.name.startswith(_BACKWARD_NODE) and _innermost(backward_ranges, e.time_range.start):
            part = part_of_sequence.get(getattr(e, "sequence_nr", -1))
            if part is not None:
                duration = e.time_range.end - e.time_range.start
                parts[part] += duration
                parts["backward"] -= duration
    parts["other"] = total_us - sum(parts[p] for p in PARTS if p != "other")
    return parts


def split_layer_step(mechanism: str, length: int, repeats: int, *, dim: int = 256, heads: int = 4,
                     options: dict[str, Any] | None = None, batch: int = 1) -> dict[str, Any]:
    """Median milliseconds of each part of `mechanism`'s causal layer training step at T = length
    (see the module docstring), the median total, and the per-step parts. `options` default to
    `bench layers`' budgets (BENCH_OPTIONS). Raises ValueError for an unregistered mechanism."""
    from routeformer.attention import build_attention, list_attentions
    from routeformer.bench.layer_calls import BENCH_OPTIONS, layer_inputs

    registered = list(list_attentions())
    if mechanism not in registered:
        raise ValueError(f"mechanism: unknown {mechanism!r}; registered: {', '.join(registered)}")
    options = BENCH_OPTIONS.get(mechanism, {}) if options is None else options
    layer = build_attention(mechanism, dim=dim, heads=heads, causal=True, **options)
    x, extra = layer_inputs(layer, length)
    leaf = x.expand(batch, -1, -1).clone().requires_grad_()
    handles = _hook_ranges(layer)

    def step() -> None:
        layer.train()
        layer.zero_grad(set_to_none=True)
        leaf.grad = None
        with torch.profiler.record_function(f"{_RANGE}forward"):
            result = layer(leaf, **extra)
            loss = result.out.square().mean() + result.aux_loss
        with torch.profiler.record_function(f"{_RANGE}backward"):
            loss.backward()

    steps = []
    try:
        step()  # warm-up (kernel builds, allocator)
        for _ in range(repeats):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                start = time.perf_counter()
                step()
                total_us = 1e6 * (time.perf_counter() - start)
            steps.append({**_exclusive_parts(profile.events(), total_us), "total": total_us})
    finally:
        for handle in handles:
            handle.remove()
    medians = {key: statistics.median(s[key] for s in steps) / 1000 for key in (*PARTS, "total")}
    return {"mechanism": mechanism, "T": length, "batch": batch, "options": options,
            "ms": medians, "steps_ms": [{k: v / 1000 for k, v in s.items()} for s in steps]}


SPLIT_HEADER = ("| T | mechanism | " + " | ".join(f"{p} ms" for p in PARTS)
                + " | total ms | sum of parts ms |\n"
                "|---|---|" + "---|" * (len(PARTS) + 2))


def format_split_row(row: dict[str, Any]) -> str:
    ms = row["ms"]
    cells = [f"{ms[p]:.1f} ({100 * ms[p] / ms['total']:.0f}%)" for p in PARTS]
    return (f"| {row['T']} | {row['mechanism']} | " + " | ".join(cells)
            + f" | {ms['total']:.1f} | {sum(ms[p] for p in PARTS):.1f} |")


def bench_split(mechanisms: Sequence[str], lengths: Sequence[int], repeats: int,
                progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`split_layer_step` for each mechanism at each length (names checked before any timing)."""
    from routeformer.attention import list_attentions

    registered = list(list_attentions())
    unknown = [m for m in mechanisms if m not in registered]
    if unknown:
        raise ValueError(f"--mechanisms: unknown {unknown}; registered: {', '.join(registered)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as compare --long times a training step
    rows = []
    try:
        progress(SPLIT_HEADER)
        for length in lengths:
            for mechanism in mechanisms:
                rows.append(split_layer_step(mechanism, length, repeats))
                progress(format_split_row(rows[-1]))
    finally:
        torch.set_num_threads(threads)
    return rows
