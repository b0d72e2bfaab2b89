"""Every kernel compiles for a GPU (sm_80 and sm_90: A100, H100) — to PTX and a cubin, with Triton's bundled
ptxas — without one being present: the interpreter tests check values, this checks that the code
is valid Triton for the real compiler (types, shapes, control flow), fp32 and bf16."""

import inspect
import os
import subprocess
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from routeformer.ops.triton import band, gathered, lse_merge, topk_decode_routing, topk_routing

# Triton 3.9 warns that its fp-fusion default will change; the launch path is unaffected.
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

FLOAT_POINTERS = {"Q", "K", "V", "OUT", "RQ", "RK", "OUTS", "MERGED", "GRAD_OUT", "GRAD_Q", "GRAD",
                  "GRAD_OUTS"}
FP32_POINTERS = {"LSE", "LSES", "GRAD_LSE", "GRAD_LSES", "GRAD_K", "GRAD_V", "GRAD_DECAY", "DECAY"}
INT_POINTERS = {"IDX": "*i64", "INDEX": "*i64", "HORIZON": "*i64", "POSITIONS": "*i64", "VALID": "*i8",
                "KEY_MASK": "*i8", "PARTIAL": "*i64"}

# Production block sizes (what `_blocks` picks on CUDA) and small ones: the same code, but the
# compiler unrolls each thread's share of a tile, so small tiles compile ~10x faster.
KERNELS = {
    "gathered forward": (gathered._routed_forward_kernel, ("BLOCK_T", "BLOCK_K", "BLOCK_D", "BLOCK_E")),
    "gathered backward": (gathered._routed_backward_kernel, ("BLOCK_T", "BLOCK_K", "BLOCK_D", "BLOCK_E")),
    "route top-K": (topk_routing._route_topk_kernel, ("BLOCK_T", "KP", "TILE", "BLOCK_R")),
    "route top-K decode chunks": (topk_decode_routing._route_chunks_kernel,
                                  ("BLOCK_Q", "KP", "TILE", "BLOCK_R")),
    "route top-K decode merge": (topk_decode_routing._merge_chunks_kernel, ("BLOCK_Q", "KP", "TILE")),
    "lse merge forward": (lse_merge._merge_forward_kernel, ("BLOCK_N", "BLOCK_E")),
    "lse merge backward": (lse_merge._merge_backward_kernel, ("BLOCK_N", "BLOCK_E")),
    "band forward": (band._band_forward_kernel, ("BLOCK_M", "BLOCK_K", "BLOCK_D", "BLOCK_E")),
    "band backward": (band._band_backward_kernel, ("BLOCK_M", "BLOCK_K", "BLOCK_D", "BLOCK_E")),
}
PRODUCTION = dict(BLOCK_T=16, BLOCK_K=16, BLOCK_D=64, BLOCK_E=64, KP=64, TILE=64, BLOCK_R=16, BLOCK_N=32,
                  BLOCK_M=16, BLOCK_Q=1)
# The decode kernels' tiles for one query (topk_decode_routing._sizes and its merge tile).
PRODUCTION_TILES = {"route top-K decode chunks": dict(TILE=512), "route top-K decode merge": dict(TILE=1024)}
SMALL = dict(BLOCK_T=8, BLOCK_K=8, BLOCK_D=16, BLOCK_E=16, KP=16, TILE=16, BLOCK_R=16, BLOCK_N=16, BLOCK_M=8,
             BLOCK_Q=2)
# Kernels whose small compile reads bf16 (the rest fp32): a decoding step's routing keys are bf16.
SMALL_BF16 = {"gathered forward", "route top-K decode chunks"}
FLAGS = dict(CAUSAL=True, HAS_MASK=True, HAS_POSITIONS=True)


def constants_for(name, sizes):
    kernel, blocks = KERNELS[name]
    names = triton.jit(kernel.fn).arg_names
    return kernel, {**{b: sizes[b] for b in blocks}, **{f: v for f, v in FLAGS.items() if f in names}}


def compile_for_cuda(kernel, constants, element, capability=90):
    jitted = triton.jit(kernel.fn)
    signature = {}
    for name in jitted.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in FLOAT_POINTERS:
            signature[name] = f"*{element}"
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name in INT_POINTERS:
            signature[name] = INT_POINTERS[name]
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    if "constexprs" in inspect.signature(ASTSource.__init__).parameters:  # triton >= 3.3
        source = ASTSource(fn=jitted, signature=signature,
                           constexprs={(jitted.arg_names.index(n),): v for n, v in constants.items()})
    else:  # triton 3.2: constants by name
        source = ASTSource(fn=jitted, signature=signature, constants=dict(constants))
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


def compile_in_fresh_process(name: str, sizes: str, element: str, capability: int = 90) -> None:
    """Compile in a new interpreter: in the full suite, an earlier interpreted launch (Triton's
    interpreter patches `triton.language` while a kernel runs) left the code generator unusable in
    this process ('value' object has no attribute 'dtype'), so each compile gets a clean Triton."""
    done = subprocess.run([sys.executable, __file__, name, sizes, element, str(capability)],
                          capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, (done.stdout + done.stderr)[-4000:]


def _compile_and_check(name: str, sizes: str, element: str, capability: str = "90") -> None:
    kernel, constants = constants_for(name, SMALL if sizes == "small"
                                      else {**PRODUCTION, **PRODUCTION_TILES.get(name, {})})
    compiled = compile_for_cuda(kernel, constants, element, int(capability))
    assert compiled.asm["cubin"] and "ld.global" in compiled.asm["ptx"]
    print("compiled")


@pytest.mark.parametrize("capability", [80, 90])  # A100, H100
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_compiles_for_sm80_and_sm90(name, capability):
    """Small tiles, fp32 (bf16 for SMALL_BF16): seconds per kernel."""
    compile_in_fresh_process(name, "small", "bf16" if name in SMALL_BF16 else "fp32", capability)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ROUTEFORMER_SLOW_TESTS") != "1", reason="set ROUTEFORMER_SLOW_TESTS=1 "
                    "(7-15 s per kernel on one core)")
@pytest.mark.parametrize("element", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_compiles_for_sm90_at_production_sizes(name, element):
    compile_in_fresh_process(name, "production", element)


if __name__ == "__main__":  # python test_cuda_compile.py NAME small|production fp32|bf16 [CAPABILITY]
    import warnings

    warnings.filterwarnings("ignore", "TRITON_DEFAULT_FP_FUSION")
    _compile_and_check(*sys.argv[1:5])
