"""Recall tasks (distinct questions, true chance, rules checked independently) and ListOps (labels are
the expression's value, rules checked independently)."""

import pytest
import torch

from routeformer.data.listops import CLOSE, DIGIT_BASE, OPERATOR_BASE, OPERATORS, PAD, evaluate_tree
from routeformer.data.recall_tasks import ANSWER, NUMBER_BASE, QUERY
from routeformer.tasks import IGNORE_INDEX, build_task
from routeformer.tasks.listops import QUESTION


def questions(row: list[int], arity: int) -> list[tuple[int, ...]]:
    """The (key, detail...) of every "? ... =" question in a token row."""
    found = []
    for start, token in enumerate(row):
        if token == QUERY and ANSWER in row[start:]:
            end = row.index(ANSWER, start)
            found.append(tuple(row[start + 1:end]))
    return found


@pytest.mark.parametrize("name, arity", [("list_recall", 2), ("segment_counting", 2), ("parity", 1)])
def test_no_question_is_asked_twice(name, arity):
    task = build_task(name, segments=4, segment_length=3, queries=4)
    inputs, _ = task.batch(512, torch.Generator().manual_seed(0))
    for row in inputs.tolist():
        asked = questions(row, arity)
        assert len(asked) >= 3 and len(asked) == len(set(asked))


def test_parity_asks_every_segment_once_when_queries_equal_segments():
    task = build_task("parity", segments=4, queries=4)
    with pytest.raises(ValueError, match="queries must be <= 4"):
        build_task("parity", segments=4, queries=5)
    # with as many questions as segments, every answer is fresh: the copy rule sits at chance
    assert abs(task.baselines(2048)["repeat the previous answer"] - 0.5) < 0.03
    assert task.chance == 0.5


def test_previous_answer_rule_matches_an_independent_implementation():
    task = build_task("parity", segments=8, queries=6)
    inputs, labels = task.fixed_sample("test", 512, seed=12345)
    correct = total = 0
    for row, label_row in zip(inputs.tolist(), labels.tolist(), strict=True):
        previous = None
        for t, label in enumerate(label_row):
            if label == IGNORE_INDEX:
                continue
            guess = NUMBER_BASE if previous is None else previous
            correct += guess == label
            total += 1
            previous = row[t + 1] if t + 1 < len(row) else None
    assert task.baselines(512)["repeat the previous answer"] == pytest.approx(correct / total)


def test_counting_chance_is_the_binomial_mode():
    task = build_task("segment_counting", segment_length=4)
    assert task.chance == pytest.approx(4 * 0.25 * 0.75**3)  # P(count = 1)
    _, labels = task.batch(4096, torch.Generator().manual_seed(1))
    answers = labels[labels != IGNORE_INDEX] - NUMBER_BASE
    assert float((answers == 1).float().mean()) == pytest.approx(task.chance, abs=0.03)


def test_copying_rules_copy_one_segment():
    task = build_task("copying", segments=4, segment_length=3)
    assert all(abs(value - (1 / 4 + 3 / 4 / 64)) < 0.04 for value in task.baselines(2048).values())
    with pytest.raises(ValueError, match="queries must be 1"):
        build_task("copying", queries=2)


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
