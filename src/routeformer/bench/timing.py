"""Timing and peak-memory measurement on CPU (and CUDA when the tensors live there).

Timings: callables are run in alternation (A, B, C, then C, B, A, ...) so that a noisy neighbour
hurts all of them alike and none always runs first, and the median of the repetitions is reported
(or the quartiles of the per-round ratios, `ratio_quartiles`).
Peak memory on CPU: the process's resident-set high-water mark (Linux /proc), reset before the
call, minus the resident set before it — the extra memory the call needed. Freed heap memory is
returned to the OS first (malloc_trim), so an earlier call's cached pages do not hide the peak.
"""

from __future__ import annotations

import ctypes
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _release_free_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_mib(fn: Callable[[], object]) -> float | None:
    """Extra peak memory (MiB) that `fn()` needed; None where it cannot be measured."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    if not _CLEAR_REFS.exists():
        return None
    _release_free_heap()
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    before = _status_kib("VmRSS")
    fn()
    return max(0, _status_kib("VmHWM") - before) / 1024


def round_times(fns: dict[str, Callable[[], object]], repeats: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Wall-clock seconds of each callable in each of `repeats` rounds (after `warmup` rounds).

    Every round runs every callable once; odd rounds run them in reverse order, so none always
    runs first (cold caches, freshly released memory) or always second."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + repeats):
        order = list(fns.items())
        for name, fn in order if round_index % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """The median of each callable's times (as `round_times` returns them)."""
    return {name: statistics.median(values) for name, values in times.items()}


def median_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median wall-clock seconds of each callable over `repeats` alternating rounds (round_times)."""
    return medians(round_times(fns, repeats, warmup))


def ratio_quartiles(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile) of the per-round ratios numerator / denominator:
    the pairing cancels the drift a shared machine adds to both sides of one round."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    low, median, high = statistics.quantiles(ratios, n=4)
    return low, median, high


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"Python {platform.python_version()}, {platform.system()}")
