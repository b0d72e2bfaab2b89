"""Every mechanism under torch.compile gives the eager layer's outputs and gradients; the layers
without data-dependent shapes compile to one graph (no graph break).

The "aot_eager" backend traces the forward and backward graphs exactly as the default inductor
backend does, without generating C++ (the benchmark `routeformer bench compile` uses inductor)."""

import pytest
import torch

from routeformer.attention import list_attentions
from routeformer.bench.compile_bench import graph_breaks
from routeformer.ops.expanding import expanding_attention
from routeformer.ops.native import native_kernels
from tests.attention.test_contract import DIM, make_layer

LENGTH = 24
needs_native = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no C compiler here")


def _forward_backward(module, x, **extra):
    """(out, stats, grad of x, grads of the parameters) of one training step's attention work."""
    inputs = x.clone().requires_grad_()
    result = module(inputs, **extra)
    result.out.square().sum().backward()
    return result.out.detach(), result.stats, inputs.grad


@pytest.mark.parametrize("name", list(list_attentions()))
def test_compiled_layer_matches_eager(name):
    torch._dynamo.reset()
    layer = make_layer(name, causal=True)
    x = torch.randn(2, LENGTH, layer.dim, generator=torch.Generator().manual_seed(0))
    extra = {"meta_mask": torch.rand(2, LENGTH, generator=torch.Generator().manual_seed(1)) < 0.2} \
        if getattr(layer, "reads_meta_mask", False) else {}
    compiled = torch.compile(layer, backend="aot_eager")
    # One compiled call: forward and backward graphs.
    (out, _, grad), (compiled_out, _, compiled_grad) = (
        _forward_backward(module, x, **extra) for module in (layer, compiled))
    torch.testing.assert_close(compiled_out, out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(compiled_grad, grad, atol=1e-4, rtol=1e-4)


# The layers whose forward has no data-dependent shape or host sync (expanding and topk: on their
# native paths).
ONE_GRAPH = ["full", "gated", "multihop", "local", "linear", "meta",
             pytest.param("expanding", marks=needs_native), pytest.param("topk", marks=needs_native)]


@pytest.mark.parametrize("name", ONE_GRAPH)
def test_fixed_shape_layers_compile_to_one_graph(name):
    layer = make_layer(name, causal=True)
    explained = graph_breaks(layer, torch.randn(1, LENGTH, DIM), {})
    assert (explained["graphs"], explained["breaks"]) == (1, 0), explained


@needs_native
def test_expanding_fullgraph_matches_eager_values_stats_and_gradients():
    """fullgraph=True (a graph break would raise) in training mode; the windows vary (a prior of
    17 keys at T=48, so queries widen by different amounts); values, every statistic and the
    gradients of the input and of the prior's parameters equal eager's."""
    torch._dynamo.reset()
    layer = make_layer("expanding", causal=True).train()
    x = torch.randn(2, 48, layer.dim, generator=torch.Generator().manual_seed(2))
    results = []
    for module in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        layer.zero_grad(set_to_none=True)
        out, stats, grad = _forward_backward(module, x)
        params = {name: p.grad.clone() for name, p in layer.named_parameters()}
        results.append((out, stats, grad, params))
    (out, stats, grad, params), (c_out, c_stats, c_grad, c_params) = results
    assert float(stats["window_max"]) > 17 and float(stats["iterations_max"]) > 1  # windows widened
    torch.testing.assert_close(c_out, out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(c_grad, grad, atol=1e-4, rtol=1e-4)
    assert c_stats.keys() == stats.keys()
    for key in stats:
        torch.testing.assert_close(c_stats[key], stats[key], rtol=1e-6, atol=0, msg=key)
    assert params.keys() == c_params.keys() >= {"alpha_raw", "beta_raw"}
    for key in params:
        torch.testing.assert_close(c_params[key], params[key], atol=1e-4, rtol=1e-4, msg=key)


def test_expanding_band_path_under_compile_matches_eager():
    """Padded input: the band path, which runs outside the compiled graph (one break), still
    gives eager's real rows and gradients."""
    torch._dynamo.reset()
    layer = make_layer("expanding", causal=True)
    x = torch.randn(2, LENGTH, layer.dim, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[1, 17:] = False
    compiled = torch.compile(layer, backend="aot_eager")
    (out, _, grad), (c_out, _, c_grad) = (_forward_backward(m, x, mask=mask) for m in (layer, compiled))
    torch.testing.assert_close(c_out[mask], out[mask], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(c_grad, grad, atol=1e-4, rtol=1e-4)


@needs_native
def test_expanding_unsynced_counts_equal_the_synced_ints():
    """sync_stats=False returns the native path's counts as 0-d tensors with the same values."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen) for _ in range(3))
    alpha, beta = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 9.0])
    synced = expanding_attention(q, k, v, alpha, beta)
    lazy = expanding_attention(q, k, v, alpha, beta, sync_stats=False)
    torch.testing.assert_close(lazy.out, synced.out, atol=0, rtol=0)
    for field in ("scored_pairs", "value_pairs", "step_entries", "flops"):
        value = getattr(lazy, field)
        assert isinstance(value, torch.Tensor) and value.dim() == 0, field
        assert isinstance(getattr(synced, field), int) and int(value) == getattr(synced, field), field


@needs_native
def test_expanding_compiled_across_lengths_matches_eager():
    """A second length recompiles with a symbolic length (automatic dynamic shapes): the native
    path's shapes and counts must trace symbolically and still give eager's values and stats."""
    torch._dynamo.reset()
    layer = make_layer("expanding", causal=True)
    compiled = torch.compile(layer, backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    for length in (24, 31, 40):
        x = torch.randn(2, length, layer.dim, generator=gen)
        expected, actual = layer(x), compiled(x)
        torch.testing.assert_close(actual.out, expected.out, atol=1e-5, rtol=1e-4)
        for key in expected.stats:
            torch.testing.assert_close(actual.stats[key], expected.stats[key], rtol=1e-6, atol=0, msg=key)


def test_meta_tokens_breaks_its_graph_once_at_the_packing():
    # The packing's sizes depend on the data (how many meta-tokens per row): one break there, run
    # eagerly; the statistics stay tensors, so no other host read breaks the graph.
    layer = make_layer("meta_tokens", causal=True)
    meta_mask = torch.rand(1, LENGTH, generator=torch.Generator().manual_seed(2)) < 0.2
    explained = graph_breaks(layer, torch.randn(1, LENGTH, DIM), {"meta_mask": meta_mask})
    assert (explained["graphs"], explained["breaks"]) == (2, 1), explained


def _linear_calls(graph: torch.fx.GraphModule) -> int:
    return sum(node.op == "call_function" and node.target is torch.nn.functional.linear
               for node in graph.graph.nodes)


def test_meta_tokens_packs_before_projecting_so_the_layer_work_is_one_graph():
    # Packing after the projections split the projections' backward from the attention's and cost
    # ~4% of a compiled training step (0.96x eager at T = 1024, docs/results/compile.md): the break
    # comes first, and every projection (standard q/k/v and output, meta q/k/v and output) lands in
    # the second graph.
    torch._dynamo.reset()
    layer = make_layer("meta_tokens", causal=True)
    meta_mask = torch.rand(1, LENGTH, generator=torch.Generator().manual_seed(2)) < 0.2
    graphs = torch._dynamo.explain(layer)(torch.randn(1, LENGTH, DIM), meta_mask=meta_mask).graphs
    assert [_linear_calls(graph) for graph in graphs] == [0, 4]


def _native_calls(layer, grad: bool) -> list[tuple[str, object]]:
    """(custom op, its last argument) of every routeformer op in the layer's traced graphs."""
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        graphs = torch._dynamo.explain(layer)(torch.randn(1, LENGTH, DIM)).graphs
    return [(str(node.target), node.args[-1]) for graph in graphs for node in graph.graph.nodes
            if str(node.target).startswith("routeformer.")]


@needs_native
def test_compiled_topk_with_recency_routing_takes_the_tiled_kernel_like_eager():
    # The recency dim (key positions, up to T) widens the speculative kernel's bf16 margin; eagerly
    # a data check sends such vectors to the tiled kernel, which compiled graphs could not read
    # (0.93x eager's forward at T = 1024-4096). The layer now says so itself.
    layer = make_layer("topk", causal=True)
    assert "recency" in layer.router.positions
    assert [name for name, _ in _native_calls(layer, grad=False)] == [
        "routeformer.route_topk.default", "routeformer.routed_attention.default"]


@needs_native
def test_compiled_linear_saves_its_states_only_for_a_gradient():
    # causal_linear's last argument says whether the per-chunk states are saved for the backward:
    # a compiled inference graph skipped nothing before (0.92x eager's forward at T = 4096).
    layer = make_layer("linear", causal=True)
    assert _native_calls(layer, grad=False) == [("routeformer.causal_linear.default", False)]
    assert _native_calls(layer, grad=True) == [("routeformer.causal_linear.default", True)]
