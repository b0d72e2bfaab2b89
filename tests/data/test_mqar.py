"""The MQAR generator: every label is the value that followed its key in the context."""

import pytest
import torch

from routeformer.data.mqar import FILLER, MQARConfig, mqar_batch


def test_labels_are_the_values_bound_to_the_queried_keys():
    config = MQARConfig(seq_len=96, pairs=8, vocab_size=64)
    inputs, labels = mqar_batch(config, 16, torch.Generator().manual_seed(0))
    assert inputs.shape == labels.shape == (16, 96)
    for row_inputs, row_labels in zip(inputs, labels, strict=True):
        keys, values = row_inputs[0:16:2], row_inputs[1:16:2]
        assert len(set(keys.tolist())) == 8 and (keys < 32).all() and (keys >= 1).all()
        assert (values >= 32).all()
        binding = dict(zip(keys.tolist(), values.tolist(), strict=True))
        positions = (row_labels >= 0).nonzero().flatten()
        assert len(positions) == 8 and (positions >= 16).all()
        for position in positions.tolist():
            key = row_inputs[position].item()
            assert row_labels[position].item() == binding[key]
            assert row_inputs[position + 1].item() == binding[key]  # the answer follows (teacher forcing)
        asked = set(row_inputs[positions].tolist())
        assert asked == set(keys.tolist())
        rest = torch.ones(96, dtype=torch.bool)
        rest[:16] = False
        rest[positions] = False
        rest[positions + 1] = False
        assert (row_inputs[rest] == FILLER).all()


def test_generator_is_seeded():
    config = MQARConfig(seq_len=64, pairs=4, vocab_size=64)
    a = mqar_batch(config, 4, torch.Generator().manual_seed(3))
    b = mqar_batch(config, 4, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "values, message",
    [({"seq_len": 30, "pairs": 8}, "seq_len must be >= 4·pairs"),
     ({"pairs": 0}, "pairs must be a positive integer"),
     ({"vocab_size": 16, "pairs": 10, "seq_len": 64}, "vocab_size must give")],
)
def test_bad_configs_raise(values, message):
    with pytest.raises(ValueError, match=message):
        MQARConfig(**values)
