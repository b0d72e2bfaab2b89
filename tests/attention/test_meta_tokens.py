"""The `meta_tokens` layer and its wiring in the backbone (meta mask, positional zeroing)."""

import pytest
import torch

from routeformer.attention import build_attention
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM

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
    full.load_state_dict(meta_layer.state_dict())
    torch.testing.assert_close(meta_layer(x).out, full(x).out)


@pytest.mark.parametrize("options", [{}, {"combine": "gated"}, {"meta_projections": "separate"},
                                     {"combine": "gated", "meta_projections": "separate", "rotary": True}])
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


@pytest.mark.parametrize("options, names", [({"combine": "gated"}, ["gate_proj.weight"]),
                                            ({"meta_projections": "separate"}, ["meta_qkv_proj.weight"])])
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
    x, meta = data()
    with pytest.raises(ValueError, match="meta_mask"):
        layer()(x, meta_mask=meta.float())


def model(positions, **extra):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=12, dim=DIM, depth=2, heads=HEADS, attention="meta_tokens",
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
