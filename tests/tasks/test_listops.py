"""ListOps: the grammar's generator (values, format, lengths, seeding) and the task built on it
(labels are the expression's value, rules checked independently)."""

import pytest

from routeformer.tasks import IGNORE_INDEX, build_task
from routeformer.tasks.listops import (
    CLOSE,
    DIGIT_BASE,
    OPERATOR_BASE,
    OPERATORS,
    PAD,
    QUESTION,
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


def parse(tokens: list[int]):
    """Rebuild the tree of a ListOps token list (prefix form)."""
    def node(position):
        token = tokens[position]
        if DIGIT_BASE <= token < OPERATOR_BASE:
            return token - DIGIT_BASE, position + 1
        operator, children, position = OPERATORS[token - OPERATOR_BASE], [], position + 1
        while tokens[position] != CLOSE:
            child, position = node(position)
            children.append(child)
        return (operator, children), position + 1
    return node(0)[0]


def test_listops_labels_are_the_values_and_the_flat_rule_ignores_nesting():
    task = build_task("listops", seq_len=48, max_length=47, pool=4000)
    assert not task.causal and task.pad_id == PAD
    inputs, labels = task.fixed_sample("test", 300)
    flat_correct = 0
    for row, label_row in zip(inputs.tolist(), labels.tolist(), strict=True):
        assert row[0] == QUESTION and all(label == IGNORE_INDEX for label in label_row[1:])
        tokens = [t for t in row[1:] if t != PAD]
        tree = parse(tokens)
        assert label_row[0] == DIGIT_BASE + evaluate_tree(tree)
        digits = [t - DIGIT_BASE for t in tokens if DIGIT_BASE <= t < OPERATOR_BASE]
        flat_correct += label_row[0] == DIGIT_BASE + evaluate_tree((tree[0], digits))
    assert task.baselines(300)["outer operator on all digits (flat)"] == pytest.approx(flat_correct / 300)
    mask = task.mask(inputs)
    assert mask is not None and bool(mask[:, 0].all()) and not bool(mask.all())
