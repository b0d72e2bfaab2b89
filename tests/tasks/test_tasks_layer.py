"""The tasks layer: registry, disjoint splits, the Task contract for every registered task, speed."""

import functools
import tempfile
import time
from pathlib import Path

import pytest
import torch

from routeformer.tasks import IGNORE_INDEX, SPLITS, build_task, list_tasks, split_of
from tests.data.test_pystdlib import write_pystdlib

SMALL = {"lm": {"seq_len": 32}, "listops": {"seq_len": 32, "max_length": 31, "pool": 3000}}
LANGUAGE_MODELS = ("lm", "code_lm")  # splits are disjoint stretches of text, not hash splits


@functools.lru_cache(maxsize=1)
def tiny_pystdlib() -> str:
    """A small pystdlib folder (code_lm's corpus), so these tests need no ../shared/data."""
    folder = Path(tempfile.mkdtemp(prefix="pystdlib-")) / "py"
    documents = {name: [(f"{name}{i}.py", f"# {name} {i}\nimport os\n" + f"value_{i} = {i}\n" * 40)
                        for i in range(4)] for name in ("train", "valid", "test")}
    return str(write_pystdlib(folder, documents))


def small_task(name):
    if name == "code_lm":
        return build_task(name, corpus=f"pystdlib:{tiny_pystdlib()}", seq_len=64)
    return build_task(name, **SMALL.get(name, {}))


def test_registry_lists_tasks_and_rejects_unknown_names_and_options():
    tasks = list_tasks()
    assert {"mqar", "lm", "listops", "list_recall", "segment_counting", "parity", "copying",
            "previous_token"} <= set(tasks)
    assert tasks["mqar"]["pairs"] == 4
    with pytest.raises(ValueError, match=r"unknown task 'nope'; registered: \[.*'mqar'"):
        build_task("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['keys'\] for task 'mqar'; valid options: "):
        build_task("mqar", keys=3)


@pytest.mark.parametrize("name", list(list_tasks()))
def test_every_task_keeps_the_contract(name):
    task = small_task(name)
    inputs, labels = task.batch(16, torch.Generator().manual_seed(0))
    assert inputs.shape == labels.shape == (16, task.seq_len)
    assert inputs.dtype == labels.dtype == torch.long
    assert int(inputs.min()) >= 0 and int(inputs.max()) < task.vocab_size
    asked = labels != IGNORE_INDEX
    assert bool(asked.any()) and int(labels[asked].max()) < task.vocab_size
    assert isinstance(task.causal, bool) and 0 < task.chance
    baselines = task.baselines(256)
    assert baselines and all(isinstance(value, float) for value in baselines.values())
    # seeded: the same generator state gives the same batch
    again = task.batch(16, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)
    fixed = task.fixed_sample("validation", 8)
    assert torch.equal(fixed[0], task.fixed_sample("validation", 8)[0])
    if task.causal:  # labels of a causal task are what the model cannot see yet: never its own input
        assert not bool((labels[asked] == inputs[asked]).all())


@pytest.mark.parametrize("name", [n for n in list_tasks() if n not in LANGUAGE_MODELS])
def test_splits_are_disjoint_by_construction(name):
    task = small_task(name)
    rows = {}
    for split in SPLITS:
        inputs, _ = task.batch(600 if split == "train" else 200, torch.Generator().manual_seed(7), split)
        assert set(split_of(inputs)) == {split}
        rows[split] = {tuple(row) for row in inputs.tolist()}
    assert not rows["train"] & rows["validation"]
    assert not rows["train"] & rows["test"]
    assert not rows["validation"] & rows["test"]


def test_lm_splits_are_disjoint_stretches_and_baselines_are_ngrams():
    task = build_task("lm", seq_len=64)
    train, validation, test = (task.ids(split) for split in SPLITS)
    assert len(validation) > 1000 and abs(len(validation) - len(test)) <= 1
    assert task.metric == "bits_per_char" and not task.higher_is_better
    baselines = task.baselines()
    # bigram beats unigram beats the uniform guess, all measured on the test split
    assert baselines["bigram (bits/char)"] < baselines["unigram (bits/char)"] < task.chance
    counts = torch.bincount(train, minlength=task.vocab_size).double() + 1
    unigram = float(-(counts / counts.sum()).log2()[test[1:]].mean())
    assert baselines["unigram (bits/char)"] == pytest.approx(unigram)


def test_batch_rejects_bad_arguments():
    task = build_task("mqar")
    with pytest.raises(ValueError, match="split must be one of"):
        task.batch(4, torch.Generator(), "dev")
    with pytest.raises(ValueError, match="batch_size must be a non-negative integer"):
        task.batch(-1, torch.Generator())
    assert task.batch(0, torch.Generator())[0].shape == (0, task.seq_len)


@pytest.mark.parametrize("name, options", [("mqar", dict(seq_len=256, pairs=16, vocab_size=8192)),
                                           ("previous_token", {}), ("listops", {}), ("list_recall", {}),
                                           ("segment_counting", {}), ("parity", {}), ("copying", {})])
def test_generators_cost_nothing_next_to_training(name, options):
    """>= 1M tokens/s (best of five, so a busy machine does not fail it; idle: ~2e7 for MQAR)."""
    task = build_task(name, **options)
    task.batch(8, torch.Generator())  # builds any pool first
    best = 0.0
    for seed in range(5):
        began = time.perf_counter()
        inputs, _ = task.batch(8192, torch.Generator().manual_seed(seed))
        best = max(best, inputs.numel() / (time.perf_counter() - began))
    assert best >= 1e6, f"{name}: {best:.3g} tokens/s"
