"""Triton kernels for the routed ops: the GPU path.

One file per kernel, each with its forward and backward wrapped as a `torch.autograd.Function`:

- `gathered`: attention over each query's gathered keys (top-k routing's exact half, and MiTA's
  routed experts, whose slots are the keys of the experts a query is routed to), returning the
  log-sum-exp with a gradient so partial results can be merged;
- `topk_routing`: the routing top-K selection (scores in tiles, a running top-K per query; no
  backward: the selection is hard);
- `topk_decode_routing`: the same selection in the decode shape (few queries, many keys: a cached
  decoding step), the keys split over many programs and their top-K lists merged;
- `lse_merge`: the online-softmax merge of partial results (`merge_partials`), with the gradient
  through every part's log-sum-exp;
- `mita`: MiTA's routed experts (`routed_parts`) on the gathered kernel;
- `band`: the banded pass with a per-query horizon and distance decay (expanding attention's final
  pass; the causal full/local rows of hard-routed `meta`).

ops/backends.py decides: CUDA tensors go to these kernels, CPU tensors stay on the native C kernels
and the PyTorch ops. Each op imports its kernel here inside its Triton branch (triton is optional);
the kernels import only lower helpers (ops/topk/slots.py, ops/attention_lse.py's constants,
ops/flops.py), never the ops that call them.

Every kernel is tested against the PyTorch reference twin of its op on CPU tensors
through Triton's interpreter (tests/ops/triton), and on CUDA where one exists; every kernel is also
compiled for sm_80 and sm_90 in the tests, which needs no GPU. Supported triton: OLDEST_TRITON (what
torch 2.6 pins) to 3.9; CI compiles every kernel on both ends and runs the interpreter tests on the
newest (.ci/run: 3.2's interpreter cannot run them on CPU tensors).

`triton` is optional (`pip install routeformer[gpu]`): nothing here imports it until a kernel runs,
so `import routeformer` works without it. `TRITON_INTERPRET` is not needed: kernels run
interpreted when their tensors are on the CPU (`_common.Kernel`).
"""

from __future__ import annotations

import importlib.util

OLDEST_TRITON = "3.2.0"  # the gpu extra's lower bound (pyproject.toml), tested by .ci/run


def triton_available() -> bool:
    """Whether the `triton` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None
