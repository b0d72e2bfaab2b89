"""Zoology MQAR: the format, no leaks, key-blind rules at 1/pairs, baselines checked independently."""

import pytest
import torch

from routeformer.tasks import IGNORE_INDEX, build_task
from routeformer.tasks.mqar import FILLER

SETTINGS = [dict(seq_len=64, pairs=4, vocab_size=64), dict(seq_len=128, pairs=16, vocab_size=8192),
            dict(seq_len=96, pairs=8, vocab_size=40, spacing="power")]


def sample(task, count=512, split="train", seed=0):
    return task.batch(count, torch.Generator().manual_seed(seed), split)


@pytest.mark.parametrize("settings", SETTINGS)
def test_format_and_labels(settings):
    task = build_task("mqar", **settings)
    pairs, half = task.pairs, task.vocab_size // 2
    inputs, labels = sample(task)
    assert inputs.shape == labels.shape == (512, task.seq_len) and inputs.dtype == torch.long
    for row, label_row in zip(inputs.tolist(), labels.tolist(), strict=True):
        keys, values = row[0:2 * pairs:2], row[1:2 * pairs:2]
        assert len(set(keys)) == pairs and len(set(values)) == pairs  # values without replacement
        assert all(1 <= k < half for k in keys) and all(half <= v < task.vocab_size for v in values)
        answer = dict(zip(keys, values, strict=True))
        asked = [t for t, label in enumerate(label_row) if label != IGNORE_INDEX]
        assert sorted(row[t] for t in asked) == sorted(keys)  # every key asked exactly once
        for t in asked:
            assert t >= 2 * pairs and label_row[t] == answer[row[t]]
            assert t + 1 == len(row) or row[t + 1] == FILLER  # followed by filler, never by its answer
        tail = row[2 * pairs:]
        assert not set(values) & set(tail), "an answer appears in the input after the context"
        assert set(tail) <= set(keys) | {FILLER}


def test_key_blind_rules_score_one_over_pairs():
    """The old generator's leak: "answer with the first context value not yet shown after the
    context" scored 0.39 at 8 pairs. Here (independent implementation) it must be at 1/pairs."""
    task = build_task("mqar", seq_len=64, pairs=8, vocab_size=128)
    inputs, labels = sample(task, 4096, "test")
    correct = total = 0
    for row, label_row in zip(inputs.tolist(), labels.tolist(), strict=True):
        values = row[1:16:2]
        shown = set(row[16:])
        unshown = [v for v in values if v not in shown]
        guess = unshown[0]
        for label in label_row:
            if label != IGNORE_INDEX:
                correct += label == guess
                total += 1
    assert abs(correct / total - 1 / 8) < 0.02
    for name, accuracy in task.baselines(4096).items():
        assert abs(accuracy - 1 / 8) < 0.02, name


def test_baselines_match_an_independent_implementation():
    task = build_task("mqar", seq_len=48, pairs=6, vocab_size=48)
    inputs, labels = task.fixed_sample("test", 1024, seed=12345)
    first = last = in_order = total = 0
    for row, label_row in zip(inputs.tolist(), labels.tolist(), strict=True):
        values = row[1:12:2]
        asked = [label for label in label_row if label != IGNORE_INDEX]
        for j, label in enumerate(asked):
            first += label == values[0]
            last += label == values[-1]
            in_order += label == values[j]
            total += 1
    measured = task.baselines(1024)
    assert measured["first context value"] == pytest.approx(first / total)
    assert measured["last context value"] == pytest.approx(last / total)
    assert measured["j-th question -> j-th value"] == pytest.approx(in_order / total)
    assert task.chance == pytest.approx(1 / 24)


def test_power_spacing_puts_queries_near_the_context_without_an_order_shortcut():
    uniform = build_task("mqar", seq_len=256, pairs=8, vocab_size=64)
    power = build_task("mqar", seq_len=256, pairs=8, vocab_size=64, spacing="power")
    def mean_distance(task):
        _, labels = sample(task, 1024)
        return (labels != IGNORE_INDEX).nonzero()[:, 1].float().mean()
    assert mean_distance(power) < mean_distance(uniform) - 20
    # the slots drawn first (likeliest) must not go to the first keys: j-th question -> j-th value ~ 1/N
    assert power.baselines(4096)["j-th question -> j-th value"] < 1 / 8 + 0.02


@pytest.mark.parametrize("bad, message", [
    (dict(seq_len=15, pairs=4), "seq_len must be >= 4 \\* pairs = 16"),
    (dict(pairs=0), "pairs must be a positive integer"),
    (dict(pairs=8, vocab_size=16), "vocab_size must hold"),
    (dict(spacing="log"), "spacing must be one of"),
])
def test_bad_options_raise_value_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        build_task("mqar", **bad)
