"""The `meta_tokens` layer and its wiring in the backbone (meta mask, positional zeroing)."""

import pytest
import torch

from routeformer.attention import build_attention
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.ops.full import full_attention_reference
from routeformer.ops.meta_tokens import meta_token_attention_reference
from routeformer.tasks.meta_tokens import meta_positions

DIM, HEADS, T = 16, 2, 21


def layer(seed=0, **options):
    torch.manual_seed(seed)
    return build_attention("meta_tokens", dim=DIM, heads=HEADS, causal=True, **options).eval()


def data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, DIM, generator=gen)
    meta = torch.zeros(2, T, dtype=torch.bool)
    meta[0, [3, 8, 9, 15]] = True
    meta[1, [0, 12]] = True
    return x, meta


def test_without_meta_mask_it_is_full_attention_with_the_same_weights():
    x, _ = data()
    meta_layer = layer()
    full = build_attention("full", dim=DIM, heads=HEADS, causal=True).eval()
    full.load_state_dict(meta_layer.state_dict(), strict=False)  # the meta projections stay out
    torch.testing.assert_close(meta_layer(x).out, full(x).out)


@pytest.mark.parametrize("options", [{}, {"combine": "gated"}, {"meta_input": "parallel"},
                                     {"meta_input": "parallel", "meta_projections": "shared"},
                                     {"combine": "gated", "meta_input": "parallel", "rotary": True},
                                     {"combine": "gated", "rotary": True}])
def test_only_meta_rows_change_and_the_future_stays_hidden(options):
    x, meta = data()
    module = layer(**options)
    plain = module(x).out
    out = module(x, meta_mask=meta).out
    torch.testing.assert_close(out[~meta], plain[~meta])
    assert (out[meta] - plain[meta]).abs().amax(-1).min() > 0
    gen = torch.Generator().manual_seed(3)
    for t in (1, 9, 16):
        x2, meta2 = x.clone(), meta.clone()
        x2[:, t:] = torch.randn(2, T - t, DIM, generator=gen) * 3
        meta2[:, t:] = ~meta2[:, t:]
        torch.testing.assert_close(module(x2, meta_mask=meta2).out[:, :t], out[:, :t])


@pytest.mark.parametrize("options, names", [
    ({"combine": "gated"}, ["gate_proj.weight"]),
    ({}, ["meta_qkv_proj.weight", "meta_out_proj.weight"]),
    ({"meta_input": "parallel"}, ["meta_qkv_proj.weight"])])
def test_meta_parameters_receive_gradient(options, names):
    x, meta = data()
    module = layer(**options).train()
    module(x, meta_mask=meta).out.square().sum().backward()
    parameters = dict(module.named_parameters())
    for name in names:
        assert parameters[name].grad is not None and parameters[name].grad.abs().sum() > 0


def test_stats_report_meta_fraction_and_the_extra_flops():
    x, meta = data()
    module = layer()
    with_meta, without = module(x, meta_mask=meta).stats, module(x).stats
    assert with_meta["meta_fraction"].item() == pytest.approx(6 / (2 * T))
    assert with_meta["flops"] > without["flops"]


def test_bad_options_and_masks_are_rejected():
    with pytest.raises(ValueError, match="combine"):
        layer(combine="mul")
    with pytest.raises(ValueError, match="meta_projections"):
        layer(meta_projections="tied")
    with pytest.raises(ValueError, match="meta_input"):
        layer(meta_input="after")
    with pytest.raises(ValueError, match="meta_projections must be 'separate'"):
        layer(meta_projections="shared")  # the sequential form owns its projections
    x, meta = data()
    with pytest.raises(ValueError, match="meta_mask"):
        layer()(x, meta_mask=meta.float())


def model(positions, options=None, **extra):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=12, dim=DIM, depth=2, heads=HEADS, attention="meta_tokens",
                         attention_options={"meta_tokens": options} if options else {},
                         positions=positions, max_seq_len=64, meta_token_id=1, **extra)
    return CausalLM(config).eval()


def tokens():
    ids = torch.randint(2, 12, (2, T), generator=torch.Generator().manual_seed(4))
    ids[:, [4, 11, 17]] = 1
    return ids


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_zeroed_meta_positions_make_the_model_blind_to_their_position(positions):
    ids = tokens()
    moved = torch.arange(T).expand(2, T).clone()
    moved[ids == 1] += 30  # other positions for the meta-tokens only
    zeroing = model(positions, zero_meta_positions_eval=True)
    torch.testing.assert_close(zeroing(ids).logits, zeroing(ids, positions=moved).logits)
    keeping = model(positions)
    assert not torch.allclose(keeping(ids).logits, keeping(ids, positions=moved).logits)


def test_training_and_evaluation_switches_are_independent():
    ids = tokens()
    net = model("learned", zero_meta_positions_train=True)
    moved = torch.arange(T).expand(2, T).clone()
    moved[ids == 1] += 30
    net.train()
    torch.testing.assert_close(net(ids).logits, net(ids, positions=moved).logits)
    net.eval()  # evaluation keeps positions: the switch for it is off
    assert not torch.allclose(net(ids).logits, net(ids, positions=moved).logits)
    net.config.zero_meta_positions_eval = True  # switch at inference on a built model
    torch.testing.assert_close(net(ids).logits, net(ids, positions=moved).logits)


def test_backbone_finds_meta_tokens_by_id():
    ids = tokens()
    net = model("rotary")
    stats = net(ids).stats
    assert stats[0]["meta_fraction"].item() == pytest.approx(3 / T)
    ids_other = ids.clone()
    ids_other[ids == 1] = 2
    assert net(ids_other).stats[0]["meta_fraction"].item() == 0


def test_meta_token_config_is_checked():
    with pytest.raises(ValueError, match="meta_token_id"):
        ModelConfig(vocab_size=12, meta_token_id=12)
    with pytest.raises(ValueError, match="need model.meta_token_id"):
        ModelConfig(vocab_size=12, zero_meta_positions_eval=True)


def test_sequential_form_matches_its_dense_definition():
    """out = a + [meta]·W_o'·Attn_meta(q', k', v' of x + a), a = W_o·Attn_causal(x), written densely."""
    x, meta = data()
    module = layer(rotary=True)
    positions = torch.arange(T).expand(2, T)
    q, k, v = module.project_qkv(x, positions)
    standard = module.out_proj(module.merge_heads(full_attention_reference(q, k, v, causal=True), x))
    meta_qkv = module._project_rows(x + standard, positions)
    meta_heads = meta_token_attention_reference(*(torch.zeros_like(t) for t in meta_qkv), meta, causal=True,
                                                meta_qkv=meta_qkv)  # zero standard part: meta rows only
    expected = standard + module.meta_out_proj(meta_heads.transpose(1, 2).flatten(2))
    torch.testing.assert_close(module(x, meta_mask=meta).out, expected, atol=1e-5, rtol=1e-5)


def first_layer_input(seed):
    """Block-1 input of a sequence whose meta-tokens are all `_PAUSE_` at zeroed positions: the
    same vector at every meta row, the context random."""
    x, meta = data(seed)
    x[meta] = torch.randn(DIM, generator=torch.Generator().manual_seed(99))
    return x, meta


@pytest.mark.parametrize("options", [{"meta_input": "parallel", "meta_projections": "shared"},
                                     {"meta_input": "parallel"}])
def test_parallel_meta_attention_is_blind_in_the_first_layer(options):
    """The issue's point: reading the block input in parallel with the standard attention, the
    meta-attention sees equal values at every meta row of layer 1, so what it adds is one constant
    vector: the same at every meta position and for every context."""
    module = layer(rotary=True, **options)
    added = []
    for seed in (0, 1):
        x, meta = first_layer_input(seed)
        delta = module(x, meta_mask=meta).out - module(x).out
        added.append(delta[meta])
    rows = torch.cat(added)
    torch.testing.assert_close(rows, rows[:1].expand_as(rows), atol=1e-5, rtol=1e-5)


def test_sequential_meta_attention_sees_the_context_in_the_first_layer():
    module = layer(rotary=True)
    added = []
    for seed in (0, 1):
        x, meta = first_layer_input(seed)
        plain = module(x).out
        added.append((module(x, meta_mask=meta).out - plain)[meta])
    rows = torch.cat(added)
    assert (rows - rows[:1]).abs().amax(-1)[1:].min() > 1e-3  # every meta row gets its own vector


@pytest.mark.parametrize("scheme", ["keep", "skip"])
def test_meta_position_schemes_are_shift_invariant(scheme):
    """Rotary depends on distances only, so positions offset by s give the same logits, for any
    scheme that keeps relative positions ("keep", "skip")."""
    ids = tokens()
    net = model("rotary")
    base = meta_positions(ids == 1, scheme)
    torch.testing.assert_close(net(ids, positions=base + 7).logits, net(ids, positions=base).logits,
                               atol=1e-4, rtol=1e-4)


def test_zeroed_meta_positions_break_shift_invariance():
    """The paper's zeroing puts every meta-token at position 0: a shift moves the other tokens but
    not them, and the output changes."""
    ids = tokens()
    net = model("rotary", zero_meta_positions_eval=True)
    base = torch.arange(T).expand(2, T)
    moved = (net(ids, positions=base + 7).logits - net(ids, positions=base).logits).abs().max()
    # float32 rounding gives shift-invariant schemes ~1e-7 here; the zeroed one moves by ~1e-4
    assert moved > 1e-5


def test_skip_positions_keep_the_real_tokens_distances():
    """Under "skip" the real tokens stand where they would without meta-tokens: the same sequence
    with meta-tokens removed, read by `full`, gives the real tokens the same positions."""
    ids = tokens()
    meta = ids == 1
    positions = meta_positions(meta, "skip")
    assert torch.equal(positions[~meta].view(2, -1), torch.arange(T - 3).expand(2, T - 3))
    assert torch.equal(positions[:, [4, 5]], torch.tensor([[4, 4], [4, 4]]))  # meta shares the next's
    assert torch.equal(meta_positions(meta, "keep", offset=2), torch.arange(2, T + 2).expand(2, T))
    with pytest.raises(ValueError, match="scheme"):
        meta_positions(meta, "zero")
