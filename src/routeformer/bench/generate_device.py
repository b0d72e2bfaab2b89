"""Cached decoding speed on an accelerator: one prefill per mechanism, then single-token steps,
timed with the device synchronised, rounds alternating between mechanisms (order reversed every
other round), tokens/s and the step-time ratio to `full` per context.

    python -m routeformer.bench.generate_device --contexts 4096 16384 65536 --dtype bf16

`bench generate` measures the same on the CPU (with state size and bytes read); this module exists
because a GPU step must be synchronised before it is timed. A mechanism whose prefill or step raises
is reported with its error instead of ending the run (a GPU image with another triton, say).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from routeformer.attention import baseline_name
from routeformer.bench.generate_bench import DECODE_OPTIONS, CachedDecoder, decode_model
from routeformer.bench.timing import machine_description, peak_memory_mib

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode_rates(mechanisms, contexts, *, device="cuda", dtype=torch.bfloat16, steps=16, rounds=5,
                 dim=256, heads=4, progress=print) -> list[dict]:
    device = torch.device(device)
    baseline = baseline_name()
    rows = []
    for context in contexts:
        prompt = torch.randint(2, 256, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
        runs, errors = {}, {}
        for name in mechanisms:
            try:
                model = decode_model(name, context + rounds * steps + 8, dim, 1, heads, DECODE_OPTIONS)
                model = model.to(device=device, dtype=dtype)
                runs[name] = CachedDecoder.prefill(model, prompt, reserve=context + rounds * steps + 8)
            except Exception as error:  # noqa: BLE001 - reported per mechanism, the run goes on
                errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        times: dict[str, list[float]] = {name: [] for name in runs}

        for name in list(runs):  # one warm-up step each (kernel compiles, allocator)
            try:
                runs[name].step()
            except Exception as error:  # noqa: BLE001
                errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                runs.pop(name)
                times.pop(name)
        for index in range(rounds):
            for name in (list(runs) if index % 2 == 0 else list(reversed(runs))):
                _sync(device)
                started = time.perf_counter()
                for _ in range(steps):
                    runs[name].step()
                _sync(device)
                times[name].append((time.perf_counter() - started) / steps)
        for name in mechanisms:
            row = {"mechanism": name, "context": context, "device": str(device), "dtype": str(dtype)}
            if name in errors:
                row["error"] = errors[name]
            else:
                median = statistics.median(times[name])
                full = statistics.median(times[baseline]) if baseline in times else None
                row.update(step_ms=median * 1e3, tokens_per_s=1 / median,
                           speedup_vs_full=None if full is None else full / median,
                           peak_mib=peak_memory_mib(runs[name].step))
            rows.append(row)
            progress(format_row(row))
        runs.clear()
    return rows


def format_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['mechanism']} | {row['context']} | {row['dtype']} | error: {row['error']} |"
    speedup = "" if row["speedup_vs_full"] is None else f"{row['speedup_vs_full']:.2f}x"
    peak = "n/a" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
    return (f"| {row['mechanism']} | {row['context']} | {row['dtype']} | {row['step_ms']:.3f} | "
            f"{row['tokens_per_s']:.0f} | {speedup} | {peak} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mechanisms", nargs="+", default=["full", "topk", "local"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["bf16"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"decode steps on {args.device}: 1 layer, D=256, 4 heads, B=1, {DECODE_OPTIONS['topk']} for topk, "
          f"{DECODE_OPTIONS['local']} for local; medians of {args.rounds} alternating rounds of {args.steps} "
          f"steps; {machine_description()}"
          + (f"; {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""), flush=True)
    print("| mechanism | context | dtype | step ms | tokens/s | speed-up vs full | peak MiB |\n"
          "|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        decode_rates(args.mechanisms, args.contexts, device=args.device, dtype=DTYPES[dtype],
                     steps=args.steps, rounds=args.rounds, progress=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
