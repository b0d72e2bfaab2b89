"""ListOps generator (values, format, lengths, seeding) and the digits loader."""

import pytest
import torch

from routeformer.data.digits import load_digits
from routeformer.data.listops import (
    CLOSE,
    ListOpsConfig,
    decode,
    evaluate_tree,
    generate_listops,
    pad_batch,
    tree_tokens,
)


@pytest.mark.parametrize(
    ("tree", "value"),
    [
        (("MAX", [2, 9, ("MIN", [4, 7]), 0]), 9),
        (("SM", [7, 9, 8]), 4),
        (("MED", [5, 1, 3]), 3),
        (("MED", [4, 1, 2, 8]), 3),  # median 3.0
        (("MED", [1, 2]), 1),  # median 1.5 -> 1
        (("MIN", [("SM", [9, 9]), 5]), 5),
    ],
)
def test_operators_follow_the_lra_definitions(tree, value):
    assert evaluate_tree(tree) == value


def test_tokens_spell_the_prefix_expression():
    assert decode(tree_tokens(("MAX", [2, ("SM", [1, 9])]))) == "[MAX 2 [SM 1 9 ] ]"


def test_generated_examples_are_seeded_in_range_and_self_consistent():
    config = ListOpsConfig(min_length=20, max_length=60, max_depth=4, max_args=5)
    examples = generate_listops(30, config, seed=3)
    assert examples == generate_listops(30, config, seed=3)
    assert examples != generate_listops(30, config, seed=4)
    for tokens, label in examples:
        assert 20 <= len(tokens) <= 60 and 0 <= label <= 9
        assert tokens[-1] == CLOSE and tokens.count(CLOSE) == sum(11 <= t <= 14 for t in tokens)


def test_pad_batch_masks_the_padding():
    tokens, mask, labels = pad_batch([([11, 3, 4, 15], 3), ([14, 2, 2, 2, 2, 15], 4)])
    assert tokens.shape == (2, 6) and mask.sum(1).tolist() == [4, 6]
    assert labels.tolist() == [3, 4] and (tokens[~mask] == 0).all()


def test_bad_listops_settings_raise():
    with pytest.raises(ValueError, match="max_length .10. must be >= min_length .20."):
        ListOpsConfig(min_length=20, max_length=10)
    with pytest.raises(ValueError, match="max_args must be an integer >= 2"):
        ListOpsConfig(max_args=1)


def test_digits_split_and_upsampling():
    train, test = load_digits()
    assert train.images.shape == (1438, 1, 8, 8) and test.images.shape == (359, 1, 8, 8)
    assert 0.0 <= float(train.images.min()) and float(train.images.max()) <= 1.0
    assert set(test.labels.tolist()) == set(range(10))
    big_train, _ = load_digits(16)
    assert big_train.images.shape == (1438, 1, 16, 16)
    torch.testing.assert_close(big_train.labels, train.labels)
    with pytest.raises(ValueError, match="size must be an integer >= 8"):
        load_digits(4)
