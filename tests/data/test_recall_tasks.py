"""The recall tasks of the meta-tokens paper: formats, answers, meta-token placement, splits."""

import pytest
import torch

from routeformer.data.recall_tasks import (
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
    split_generator,
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
    a = recall_batch(task, 4, split_generator("train", 0))[0]
    b = recall_batch(task, 4, split_generator("train", 0))[0]
    c = recall_batch(task, 4, split_generator("test", 0))[0]
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, c)


def test_bad_task_settings_are_rejected():
    with pytest.raises(ValueError, match="task name"):
        RecallTask("sorting")
    with pytest.raises(ValueError, match="segments"):
        RecallTask(segments=33)
    with pytest.raises(ValueError, match="segment_length"):
        RecallTask(segment_length=32)
    with pytest.raises(ValueError, match="split"):
        split_generator("validation", 0)
