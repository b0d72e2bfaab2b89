"""SequenceRegressor: the read-out sees only the last position's residual stream; causal layers."""

import pytest
import torch

from routeformer.models.regressor import AttentionFreeRegressor, SequenceRegressor


@pytest.mark.parametrize("mechanisms", [["full"], ["full", "full"], ["multihop"], ["expanding"]])
def test_regressor_predicts_from_the_last_position_and_learns(mechanisms):
    torch.manual_seed(0)
    model = SequenceRegressor(mechanisms, input_dim=6, model_dim=8, target_dim=2,
                              attention_options={"expanding": {"block": 4}})
    x, target = torch.randn(3, 10, 6), torch.randn(3, 2)
    out = model(x, target)
    assert out.logits.shape == (3, 2) and out.loss.shape == ()
    out.total_loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    # Causal layers: only the last position's prediction is read, and it depends on every position...
    changed = x.clone()
    changed[:, 0] += 1.0
    assert not torch.allclose(model(changed).logits, out.logits)
    # ... while the layer inputs before a change are untouched by it.
    base_inputs, _, _, _ = model.hidden_states(x)
    changed_late = x.clone()
    changed_late[:, 7:] += 1.0
    late_inputs, _, _, _ = model.hidden_states(changed_late)
    for base, late in zip(base_inputs, late_inputs, strict=True):
        torch.testing.assert_close(base[:, :7], late[:, :7])


def test_regressor_bad_arguments_raise():
    with pytest.raises(ValueError, match="mechanisms must name"):
        SequenceRegressor([], 4, 4, 1)
    with pytest.raises(ValueError, match="model_dim must be a positive integer"):
        SequenceRegressor(["full"], 4, 0, 1)
    with pytest.raises(ValueError, match="unknown attention"):
        SequenceRegressor(["nope"], 4, 4, 1)


def test_attention_free_models_cannot_see_beyond_their_mixer():
    torch.manual_seed(0)
    x = torch.randn(3, 10, 4)
    changed = x.clone()
    changed[:, :-1] += torch.randn(3, 9, 4)
    none = AttentionFreeRegressor("none", 4, 4, 2, length=10)
    torch.testing.assert_close(none(x).logits, none(changed).logits)  # the last node only
    mixer = AttentionFreeRegressor("position-only", 4, 4, 2, length=10)
    with torch.no_grad():
        mixer.distance_logits.zero_()  # uniform over the causal prefix: the mean of all positions
        hidden = mixer.embed(x)
        expected = mixer.readout(hidden[:, -1] + mixer.out_proj(mixer.value(hidden).mean(dim=1)))
        torch.testing.assert_close(mixer(x).logits, expected)
    with pytest.raises(ValueError, match="mixer must be one of"):
        AttentionFreeRegressor("conv", 4, 4, 2, length=10)
