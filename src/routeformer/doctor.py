"""`routeformer doctor`: what this machine gives the kernels, and the backend each mechanism takes.

The backends come from running each registered mechanism once on a small random input and
reading what its ops recorded (`AttentionOutput.backends`, ops/backends.py), so the answer is
what runs, not a prediction. Training (a gradient wanted) and inference (no_grad) are both shown:
some C kernels serve inference only. The length matters too: below `TOPK_DENSE_BELOW` keys the
`topk` layer attends densely, so the default length is above both of its thresholds.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

DEFAULT_LENGTH = 1100  # above both topk dense thresholds (256 native, 1024 torch)
_DIM, _HEADS = 32, 2
# CPU flags that decide which C kernels build and which variant runs (common.h, topk, local).
_CPU_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512F"), ("avx512_bf16", "AVX-512 BF16"),
                 ("amx_bf16", "AMX BF16"), ("asimd", "NEON (arm64)"))


def cpu_features() -> str:
    """The kernel-relevant features /proc/cpuinfo lists (Linux), else the machine type."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), [])
    except OSError:
        return f"{platform.machine()} (no /proc/cpuinfo: features unknown)"
    present = [label for flag, label in _CPU_FEATURES if flag in flags]
    return f"{platform.machine()}: " + (", ".join(present) if present else "none of AVX2/AVX-512/NEON")


def compiler_line() -> str:
    from routeformer.ops.native.build import compiler

    found = compiler()
    if found is None:
        return "none found (set $CC or install cc/gcc): the C kernels cannot build"
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30)
        first = (version.stdout or version.stderr).strip().splitlines()
        return f"{found} ({first[0] if first else 'no version output'})"
    except (OSError, subprocess.SubprocessError) as failed:
        return f"{found} (cannot be run: {failed})"


def native_lines() -> list[str]:
    """Whether the C library built (and why not), and which of its optional kernels are in it."""
    from routeformer.ops.native import load, native_kernels, why_not_built

    try:
        loaded = load()
    except ValueError as refused:  # a ROUTEFORMER_ISA this CPU cannot run, or not a level
        return [f"not built: {refused}"]
    if loaded is None:
        return [f"not built: {why_not_built() or 'unknown reason'} (every op runs in PyTorch)"]
    from routeformer.ops.native.local import local_kernel_available
    from routeformer.ops.native.topk import speculative_prefilter_exact, speculative_query_tile

    lines = ["built and loaded", isa_line()]
    handle = native_kernels(torch.zeros(1))
    if handle is None:
        lines.append("switched off here (ROUTEFORMER_NATIVE=0): the ops run in PyTorch")
    else:
        lines.append(f"routing limits: {handle.max_slots} slots, routing dim {handle.max_dim}")
        lines.append("local attention kernel: " + ("built" if local_kernel_available() else
                                                   "not in the library: blockwise PyTorch"))
        selection = "tiled"
        if speculative_query_tile():
            exact = speculative_prefilter_exact()
            selection = ("speculative (exact fp32 prefilter, no AVX-512 BF16)" if exact
                         else "speculative (bf16 prefilter, AVX-512 BF16)")
        lines.append("routing selection (fp32): " + selection)
    return lines


def isa_line() -> str:
    """The instruction-set level the loaded library was compiled for, and why (ROUTEFORMER_ISA)."""
    from routeformer.ops.native import compiled_isa, requested_isa
    from routeformer.ops.native.build import compiler, native_isa

    level, bf16 = compiled_isa() or ("unknown", False)
    requested = requested_isa() or "native"
    built = f"{level}" + (" + AVX-512 BF16" if bf16 else ("" if level == "generic" else
                                                        ", bf16 widened to fp32 in the kernels"))
    if requested == "native":
        why = "ROUTEFORMER_ISA unset (native): what this CPU has (-march=native)"
    else:
        found = compiler()
        best = native_isa(found) if found else "unknown"
        why = f"forced by ROUTEFORMER_ISA={requested}; this CPU has {best}"
    return f"instruction set: {built} ({why}; levels: native, avx512, avx2, generic)"


def triton_line() -> str:
    from routeformer.ops.triton import triton_available

    if not triton_available():
        return "not installed (pip install routeformer[gpu]): CUDA tensors run the PyTorch ops"
    try:
        import triton

        return f"{triton.__version__}"
    except Exception as failed:  # noqa: BLE001 - an installed but broken triton is worth reporting
        return f"installed but not importable ({type(failed).__name__}: {failed})"


def cuda_line() -> str:
    if not torch.cuda.is_available():
        return "not available"
    return f"available: {torch.cuda.get_device_name(0)} (torch {torch.version.cuda})"


def mechanism_backends(name: str, device: str, length: int) -> tuple[str, str]:
    """(training, inference) backends of mechanism `name` on fp32 `device` tensors of `length`
    tokens, as the layer reports them after one call each."""
    from routeformer.attention import build_attention

    torch.manual_seed(0)
    layer = build_attention(name, dim=_DIM, heads=_HEADS, causal=True).to(device)
    x = torch.randn(1, length, _DIM, device=device)
    extra = {"meta_mask": torch.arange(length, device=device)[None] % 8 == 0} \
        if getattr(layer, "reads_meta_mask", False) else {}
    training = layer.train()(x.requires_grad_(), **extra)
    with torch.no_grad():
        inference = layer.eval()(x.detach(), **extra)
    return _described(training), _described(inference)


def _described(result) -> str:
    ran = result.backends or {}
    detail = ", ".join(f"{op}={backend}" for op, backend in sorted(ran.items()) if backend != "torch")
    return result.backend + (f" ({detail})" if detail and "+" in result.backend else "")


def report(length: int = DEFAULT_LENGTH) -> str:
    """The whole doctor report, as printed."""
    from routeformer.attention import list_attentions
    from routeformer.ops.backends import TOPK_DENSE_BELOW, switch_values

    switches = switch_values()
    lines = ["routeformer doctor", "",
             f"C compiler:       {compiler_line()}",
             f"CPU:              {cpu_features()}"]
    native = native_lines()
    lines.append(f"native kernels:   {native[0]}")
    lines += [f"                  {line}" for line in native[1:]]
    lines += [f"triton:           {triton_line()}",
              f"CUDA:             {cuda_line()}",
              f"switches:         ROUTEFORMER_NATIVE={switches['ROUTEFORMER_NATIVE']}, "
              f"ROUTEFORMER_TRITON={switches['ROUTEFORMER_TRITON']}",
              f"topk dense below: {TOPK_DENSE_BELOW['native']} keys with the native kernels, "
              f"{TOPK_DENSE_BELOW['torch']} without (ops/backends.py: TOPK_DENSE_BELOW)", ""]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        lines.append(f"backends per mechanism ({device}, float32, T={length}; training | inference):")
        for name in list_attentions():
            try:
                training, inference = mechanism_backends(name, device, length)
            except Exception as failed:  # noqa: BLE001 - one broken mechanism must not hide the rest
                training = inference = f"failed: {type(failed).__name__}: {failed}"
            lines.append(f"  {name:12s} {training} | {inference}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
