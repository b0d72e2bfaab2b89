"""lm with documents="start": training windows anywhere inside a document, evaluation at document
starts, and the copy-predictable characters of the evaluation windows against a brute-force twin."""

import math

import pytest
import torch

from routeformer.tasks import IGNORE_INDEX, build_task
from routeformer.tasks.lm import copy_predictable_mask, document_windows_anywhere
from routeformer.train.on_task import ModelSpec, build_task_model, evaluate_on_task
from tests.data.test_pystdlib import write_pystdlib


def document_corpus(tmp_path):
    generator = torch.Generator().manual_seed(3)
    alphabet = "abcdefgh\n "

    def text(length):
        return "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (length,), generator=generator))

    documents = {"train": [(f"t{i}.py", text(30 + 17 * i)) for i in range(5)] + [("short.py", "ab")],
                 "valid": [("v0.py", text(40)), ("v1.py", text(25))],
                 "test": [("s0.py", text(7) * 6), ("s1.py", text(12) + text(5) * 4)]}  # with repeats
    return f"pystdlib:{write_pystdlib(tmp_path / 'py', documents)}", documents


def test_training_windows_lie_anywhere_inside_one_document(tmp_path):
    corpus, documents = document_corpus(tmp_path)
    task = build_task("lm", corpus=corpus, seq_len=20, documents="start")
    assert task.train_windows == "anywhere" and task.options()["train_windows"] == "anywhere"
    texts = [body for _, body in documents["train"] if len(body) >= 21]
    inputs, labels = task.batch(2000, torch.Generator().manual_seed(0), "train")
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    heads, places = {body[:21] for body in texts}, set()
    for row, label in zip(inputs, labels, strict=True):
        window = task.vocab.decode(row) + task.vocab.decode(label[-1:])
        found = [(index, body.find(window)) for index, body in enumerate(texts) if window in body]
        assert found, "a training window must lie inside one document"
        places.update(found)
    assert any(window_start > 0 for _, window_start in places)  # not only document starts
    # every one of the sum(L - T) valid windows turns up in 2000 draws
    assert len(places) == sum(len(body) - 20 for body in texts)
    for split, name in (("validation", "valid"), ("test", "test")):
        starts = {body[:21] for _, body in documents[name] if len(body) >= 21}
        fixed, fixed_labels = task.fixed_sample(split, 10)
        assert {task.vocab.decode(r) + task.vocab.decode(lab[-1:])
                for r, lab in zip(fixed, fixed_labels, strict=True)} == starts
        drawn, drawn_labels = task.batch(64, torch.Generator().manual_seed(1), split)
        assert {task.vocab.decode(r) + task.vocab.decode(lab[-1:])
                for r, lab in zip(drawn, drawn_labels, strict=True)} <= starts
    at_starts = build_task("lm", corpus=corpus, seq_len=20, documents="start", train_windows="start")
    rows, row_labels = at_starts.batch(200, torch.Generator().manual_seed(0), "train")
    assert {at_starts.vocab.decode(r) + at_starts.vocab.decode(lab[-1:])
            for r, lab in zip(rows, row_labels, strict=True)} == heads


def test_anywhere_windows_are_uniform_over_valid_windows():
    ids = torch.arange(100)
    starts, lengths = torch.tensor([0, 10, 40]), torch.tensor([10, 30, 5])  # 10 - 4, 30 - 4, 5 - 4 offsets
    generator = torch.Generator().manual_seed(0)
    inputs, labels = document_windows_anywhere(ids, starts, lengths, 33_000, 4, generator)
    first = inputs[:, 0]
    valid = torch.cat([torch.arange(0, 6), torch.arange(10, 36), torch.arange(40, 41)])
    counts = torch.bincount(first, minlength=100)
    assert set(first.unique().tolist()) == set(valid.tolist())
    assert counts[valid].float().std() / counts[valid].float().mean() < 0.1  # equally likely
    assert torch.equal(labels, inputs + 1)
    with pytest.raises(ValueError, match="at least seq_len \\+ 1 = 5 characters; shortest: 4"):
        document_windows_anywhere(ids, starts, torch.tensor([10, 30, 4]), 1, 4, torch.Generator())


def brute_force_copy_mask(inputs, labels, context, distance):
    rows, length = inputs.shape
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):
        row = inputs[b].tolist()
        for t in range(context - 1, length):
            gram = row[t - context + 1:t + 1]
            for s in range(t - 1, context - 2, -1):  # the most recent earlier occurrence, ending at s
                if row[s - context + 1:s + 1] == gram:
                    mask[b, t] = t - s > distance and row[s + 1] == int(labels[b, t])
                    break
    return mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("context", "distance"), [(1, 0), (2, 3), (3, 5), (4, 2), (8, 10)])
def test_copy_predictable_mask_equals_the_brute_force_oracle(seed, context, distance):
    generator = torch.Generator().manual_seed(seed)
    alphabet = 2 + seed % 3
    pieces = [torch.randint(0, alphabet, (int(torch.randint(3, 12, (1,), generator=generator)),),
                            generator=generator) for _ in range(4)]
    order = torch.randint(0, 4, (12,), generator=generator)  # repeated pieces: copies far and near
    text = torch.cat([pieces[i] for i in order] + [torch.randint(0, alphabet, (5,), generator=generator)])
    rows = 3
    length = (len(text) - 1) // rows
    inputs = torch.stack([text[b * length:(b + 1) * length] for b in range(rows)])
    labels = torch.stack([text[b * length + 1:(b + 1) * length + 1] for b in range(rows)])
    labels[0, -1] = IGNORE_INDEX
    expected = brute_force_copy_mask(inputs, labels, context, distance)
    assert torch.equal(copy_predictable_mask(inputs, labels, context, distance), expected)
    assert bool(expected.any()) or distance >= 5


def test_copy_predictable_mask_edge_cases():
    # slots 0-2 "1 2 3", ten 0s, slots 13-15 "1 2 3", then "0 1 2 3"
    text = torch.tensor([1, 2, 3] + [0] * 10 + [1, 2, 3] + [0, 1, 2, 3])
    inputs, labels = text[None, :-1], text[None, 1:]
    mask = copy_predictable_mask(inputs, labels, context=2, distance=4)
    assert torch.equal(mask, brute_force_copy_mask(inputs, labels, 2, 4))
    assert bool(mask[0, 14]) and bool(mask[0, 15])  # "1 2" / "2 3" last seen 13 back, then 3 / 0
    assert not bool(mask[0, 12])  # "0 0" last seen 1 back
    # "1 2" ending at 18: its most recent occurrence ends 4 back (not beyond distance 4), so the
    # far one at slot 1, whose follower 3 is the label, does not count
    assert not bool(mask[0, 18])
    assert bool(copy_predictable_mask(inputs, labels, context=2, distance=3)[0, 18])
    assert not bool(copy_predictable_mask(inputs, labels, context=2, distance=13).any())
    short = copy_predictable_mask(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 4)
    assert short.shape == (2, 3) and not bool(short.any())
    zeros = torch.zeros(1, 6, dtype=torch.long)
    ignored = copy_predictable_mask(zeros, torch.full((1, 6), IGNORE_INDEX), 1, 0)
    assert not bool(ignored.any())
    with pytest.raises(ValueError, match="context must be a positive"):
        copy_predictable_mask(inputs, labels, context=0)
    with pytest.raises(ValueError, match="distance must be a non-negative integer; got -1"):
        copy_predictable_mask(inputs, labels, distance=-1)
    with pytest.raises(ValueError, match=r"inputs and labels must both be \[N, T\]"):
        copy_predictable_mask(inputs, labels[:, 1:])


def test_the_task_caches_its_mask_and_the_evaluator_reports_bits_on_it(tmp_path):
    corpus, _ = document_corpus(tmp_path)
    task = build_task("lm", corpus=corpus, seq_len=20, documents="start")
    mask = task.copy_predictable("test", 8, context=2, distance=3)
    assert task.copy_predictable("test", 8, context=2, distance=3) is mask
    inputs, labels = task.fixed_sample("test", 8)
    assert torch.equal(mask, brute_force_copy_mask(inputs, labels, 2, 3))
    assert build_task("lm", corpus=corpus, seq_len=20).copy_predictable("test", 8) is None
    task.copy_contexts, task.copy_distance = (2, 3), 3  # the evaluation's settings, scaled to T = 20
    floors = task.copy_predictable_baselines(8)
    asked = (labels != IGNORE_INDEX).sum()
    for context in (2, 3):
        chosen = task.copy_predictable("test", 8, context)
        assert bool(chosen.any()) and not bool(chosen.all())
        assert floors["copy-predictable fraction"][str(context)] == pytest.approx(float(chosen.sum() / asked))
        assert floors["unigram (bits/char)"][str(context)] == pytest.approx(
            float(-task._unigram()[labels[chosen]].log2().mean()))
    torch.manual_seed(0)
    model = build_task_model(task, "full", {}, ModelSpec(dim=16, depth=1, heads=2))
    record = evaluate_on_task(model, task, "test", 8)
    assert set(record["bits_per_char_copy_predictable"]) == {"2", "3"}
    with torch.no_grad():
        logits = model(inputs, labels, logits_at_labels=True).logits
    nats = torch.nn.functional.cross_entropy(logits.float(), labels[labels != IGNORE_INDEX], reduction="none")
    for context in (2, 3):
        chosen = task.copy_predictable("test", 8, context)[labels != IGNORE_INDEX]
        expected = float(nats[chosen].mean()) / math.log(2) if bool(chosen.any()) else math.nan
        assert record["bits_per_char_copy_predictable"][str(context)] == pytest.approx(expected, rel=1e-5,
                                                                                       nan_ok=True)
        fraction = float(chosen.float().mean())
        assert record["copy_predictable_fraction"][str(context)] == pytest.approx(fraction)


def test_train_windows_option_round_trips_and_bad_values_raise(tmp_path):
    corpus, _ = document_corpus(tmp_path)
    for name in ("lm", "code_lm"):
        for train_windows in ("anywhere", "start"):
            task = build_task(name, corpus=corpus, seq_len=20, documents="start", train_windows=train_windows)
            again = build_task(name, **task.options())
            assert again.options() == task.options() and again.train_windows == train_windows
    assert build_task("code_lm", corpus=corpus, seq_len=20).train_windows == "anywhere"
    with pytest.raises(ValueError, match=r"train_windows must be one of \['anywhere', 'start'\]; got 'end'"):
        build_task("lm", corpus=corpus, seq_len=20, documents="start", train_windows="end")
    with pytest.raises(ValueError, match=r"train_windows='start' applies to documents='start'"):
        build_task("lm", corpus=corpus, seq_len=20, train_windows="start")
