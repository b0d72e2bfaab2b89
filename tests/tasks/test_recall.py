"""The recall tasks of the meta-tokens paper: the sequences (formats, answers, meta-token placement,
hash splits) and the tasks built on them (distinct questions, true chance, rules checked
independently)."""

import pytest
import torch

from routeformer.tasks import IGNORE_INDEX, build_task, split_of
from routeformer.tasks.recall import recall_split_batch
from routeformer.tasks.recall_sequences import (
    ANSWER,
    CLOSE,
    ITEM_BASE,
    KEY_BASE,
    MARK_CLOSE,
    MARK_OPEN,
    NUMBER_BASE,
    OPEN,
    PAUSE,
    QUERY,
    TASKS,
    RecallTask,
    recall_batch,
)


def segments_of(row):
    """{key: items} from 'K [ items ]' segments of one sequence."""
    found, tokens = {}, row.tolist()
    for i, token in enumerate(tokens):
        if token == OPEN and i > 0 and KEY_BASE <= tokens[i - 1] < ITEM_BASE:
            end = tokens.index(CLOSE, i)
            found[tokens[i - 1]] = tokens[i + 1:end]
    return found


def expected_answers(name, row):
    """Recompute every answer of one input row from its context."""
    tokens = row.tolist()
    if name == "copying":
        start = tokens.index(MARK_OPEN) + 1
        marked = tokens[start:tokens.index(MARK_CLOSE)]
        return marked
    segments, answers = segments_of(row), []
    for i, token in enumerate(tokens):
        if token != QUERY or ANSWER not in tokens[i:]:
            continue
        key = tokens[i + 1]
        items = segments[key]
        if name == "list_recall":
            answers.append(items[tokens[i + 2] - NUMBER_BASE])
        elif name == "segment_counting":
            answers.append(NUMBER_BASE + items.count(tokens[i + 2]))
        else:
            answers.append(NUMBER_BASE + sum(t - NUMBER_BASE for t in items) % 2)
    return answers


@pytest.mark.parametrize("name", TASKS)
def test_every_label_is_the_answer_its_context_implies(name):
    task = RecallTask(name, segments=5, segment_length=4, queries=3)
    inputs, labels = recall_batch(task, 16, torch.Generator().manual_seed(0))
    assert inputs.shape == labels.shape == (16, task.seq_len)
    for row, label_row in zip(inputs, labels, strict=True):
        asked = label_row[label_row != -100].tolist()
        assert asked == expected_answers(name, row)[: len(asked)]
        # Copying asks for every marked token; the others once per question.
        assert len(asked) == (task.segment_length if name == "copying" else task.queries)
        assert (row == PAUSE).sum() == task.segments  # one meta-token closes every segment


@pytest.mark.parametrize("name", TASKS)
def test_without_meta_tokens_the_sequences_are_the_same_minus_pause(name):
    task = RecallTask(name, segments=4, segment_length=3)
    with_meta, labels_meta = recall_batch(task, 4, torch.Generator().manual_seed(1))
    plain, labels_plain = recall_batch(task.with_meta(False), 4, torch.Generator().manual_seed(1))
    assert plain.shape[1] == task.with_meta(False).seq_len == task.seq_len - task.segments
    for row, plain_row in zip(with_meta, plain, strict=True):
        torch.testing.assert_close(row[row != PAUSE], plain_row)
    torch.testing.assert_close(labels_meta[labels_meta != -100], labels_plain[labels_plain != -100])


def test_pause_closes_segments_and_longer_tasks_reuse_the_vocabulary():
    task = RecallTask("list_recall", segments=4, segment_length=3)
    inputs, _ = recall_batch(task, 8, torch.Generator().manual_seed(2))
    pause_positions = (inputs == PAUSE).nonzero()[:, 1]
    assert (inputs[(inputs == PAUSE).nonzero()[:, 0], pause_positions - 1] == CLOSE).all()
    longer = task.scaled(2.0)
    assert longer.segments == 8
    long_inputs, _ = recall_batch(longer, 8, torch.Generator().manual_seed(2))
    assert long_inputs.max() < ITEM_BASE + 64 and long_inputs.shape[1] == longer.seq_len


def test_splits_are_seeded_and_disjoint_streams():
    task = RecallTask("parity")
    a = recall_split_batch(task, 4, torch.Generator().manual_seed(0), "train")[0]
    b = recall_split_batch(task, 4, torch.Generator().manual_seed(0), "train")[0]
    c = recall_split_batch(task, 4, torch.Generator().manual_seed(0), "test")[0]
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, c)
    # disjoint by construction: every sequence drawn for a split hashes to that split
    assert set(split_of(a)) == {"train"} and set(split_of(c)) == {"test"}


def test_bad_task_settings_are_rejected():
    with pytest.raises(ValueError, match="task name"):
        RecallTask("sorting")
    with pytest.raises(ValueError, match="segments"):
        RecallTask(segments=33)
    with pytest.raises(ValueError, match="segment_length"):
        RecallTask(segment_length=32)
    with pytest.raises(ValueError, match="split"):
        recall_split_batch(RecallTask("parity"), 4, torch.Generator().manual_seed(0), "dev")


# -- the registered tasks --------------------------------------------------------------------------


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
