"""lm on a corpus of documents: windows from document starts, the default stream unchanged."""

import hashlib

import pytest
import torch

from routeformer.data.corpora import data_dirs
from routeformer.tasks import IGNORE_INDEX, build_task
from tests.data.test_pystdlib import write_pystdlib


def digest(*tensors):
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


# Computed with the code at the start of this branch (b950db6), before documents= existed.
GOLDEN = {
    (): {"train": "ce3959b17c12b3ee", "fixed_train": "4e837e4e5d1bc2ca",
         "validation": "6276cf5136858840", "fixed_validation": "4e8c9e88f2cd1280",
         "test": "c505792926c3a6f4", "fixed_test": "284eca7f01f77e1c"},
    (("meta_density", 0.1),): {"train": "f62d955c68458b67", "fixed_train": "0b446b50096688a8",
                               "validation": "c425ff8da95dc541", "fixed_validation": "4deaf6d2788cd2b5",
                               "test": "ae2c4bc3fb042341", "fixed_test": "63c89e3c7b30a04d"},
}


@pytest.mark.parametrize("extra", list(GOLDEN))
def test_the_default_stream_windows_are_those_of_before(extra):
    task = build_task("lm", seq_len=64, **dict(extra))
    assert "documents" not in task.options()
    seen = {}
    for split in ("train", "validation", "test"):
        seen[split] = digest(*task.batch(8, torch.Generator().manual_seed(0), split))
        seen["fixed_" + split] = digest(*task.fixed_sample(split, 16))
    assert seen == GOLDEN[extra]
    baselines = task.baselines()
    assert baselines["bigram (bits/char)"] == pytest.approx(3.2670581355106343, rel=1e-12)


def small_corpus(tmp_path):
    letters = "abcdefghijklmnopqrstuvwxyz"
    documents = {"train": [(f"t{i}.py", letters[i:] + letters[:i]) for i in range(6)] + [("short.py", "ab")],
                 "valid": [("v0.py", letters[::-1]), ("v1.py", "xyz"), ("v2.py", letters[3:] + "abc")],
                 "test": [("s0.py", letters), ("s1.py", letters[5:] + letters[:5])]}
    return f"pystdlib:{write_pystdlib(tmp_path / 'py', documents)}", documents


def test_start_windows_begin_at_document_starts_and_skip_short_documents(tmp_path):
    corpus, documents = small_corpus(tmp_path)
    task = build_task("lm", corpus=corpus, seq_len=10, documents="start", train_windows="start")
    assert task.options()["documents"] == "start" and task.mask(torch.zeros(2, 10, dtype=torch.long)) is None
    starts = {split: task.document_starts(split).tolist() for split in ("train", "validation", "test")}
    # "short.py" ("ab") and "v1.py" ("xyz") are too short for 11 characters: skipped
    assert starts == {"train": [0, 26, 52, 78, 104, 130], "validation": [0, 29], "test": [0, 26]}
    texts = {split: {text[:11] for _, text in documents[name] if len(text) >= 11}
             for split, name in (("train", "train"), ("validation", "valid"), ("test", "test"))}
    for split in texts:
        inputs, labels = task.batch(32, torch.Generator().manual_seed(1), split)
        assert inputs.shape == (32, 10) and torch.equal(inputs[:, 1:], labels[:, :-1])
        rows = {task.vocab.decode(row) + task.vocab.decode(label[-1:])
                for row, label in zip(inputs, labels, strict=True)}
        assert rows <= texts[split]  # every row is a document's first 11 characters
        fixed, fixed_labels = task.fixed_sample(split, 100)
        assert [task.vocab.decode(row) for row in fixed] == \
            [text[:10] for _, text in documents[{"validation": "valid"}.get(split, split)] if len(text) >= 11]
        again = task.fixed_sample(split, 100)
        assert torch.equal(fixed, again[0]) and torch.equal(fixed_labels, again[1])
    assert task.fixed_sample("train", 2)[0].shape == (2, 10)  # the first two qualifying documents
    assert len(rows) > 1  # training rows draw different documents


def test_start_windows_with_meta_tokens_hold_the_document_start(tmp_path):
    corpus, _ = small_corpus(tmp_path)
    task = build_task("lm", corpus=corpus, seq_len=12, documents="start", meta_density=0.2)
    inputs, labels = task.fixed_sample("test", 4)
    real = inputs[0][inputs[0] != task.meta_token_id]
    assert task.vocab.decode(real) == "abcdefghijklmnopqrstuvwxyz"[:len(real)]
    assert bool((labels == IGNORE_INDEX).any())


def test_bad_window_options_are_value_errors_naming_the_argument(tmp_path):
    corpus, _ = small_corpus(tmp_path)
    with pytest.raises(ValueError, match=r"documents must be one of \['stream', 'start'\]; got 'begin'"):
        build_task("lm", corpus=corpus, seq_len=10, documents="begin")
    with pytest.raises(ValueError, match=r"documents='start' needs a corpus of documents.*'pydoc'"):
        build_task("lm", seq_len=10, documents="start")
    with pytest.raises(ValueError, match=r"documents='start' with seq_len=26: no train document .* has "
                                         r"the 27 characters a window needs \(longest: 26\)"):
        build_task("lm", corpus=corpus, seq_len=26, documents="start")


def test_position_baselines_are_the_ngram_floors_per_bucket(tmp_path):
    corpus, _ = small_corpus(tmp_path)
    task = build_task("lm", corpus=corpus, seq_len=10, documents="start")
    floors = task.position_baselines(position_buckets=[0, 4])
    assert set(floors) == {"unigram (bits/char)", "bigram (bits/char)"}
    assert list(floors["bigram (bits/char)"]) == ["0-4", "4-10"]
    with pytest.raises(ValueError, match="position_buckets must be strictly increasing"):
        task.position_baselines(position_buckets=[0, 4, 4])


def test_shared_pystdlib_documents_qualifying_at_long_windows():
    if not any((d / "python-stdlib/train.jsonl").exists() for d in data_dirs()):
        pytest.skip("../shared/data/python-stdlib is not beside the repository")
    for seq_len, counts in ((2048, [549, 31, 28]), (4096, [452, 28, 21])):  # as lm's docstring says
        task = build_task("lm", corpus="pystdlib", seq_len=seq_len, documents="start")
        assert [len(task.document_starts(s)) for s in ("train", "validation", "test")] == counts
    stream = build_task("lm", corpus="pystdlib", seq_len=64)
    assert len(stream.ids("test")) == 477_357  # the test file's own split, not half of valid


def test_code_lm_is_lm_on_pystdlib_file_heads_at_t4096(tmp_path):
    documents = {name: [(f"{name}{i}.py", f"# {name} {i}\n" + "x = 1\n" * 30) for i in range(3)]
                 for name in ("train", "valid", "test")}
    folder = write_pystdlib(tmp_path / "py", documents)
    task = build_task("code_lm", corpus=f"pystdlib:{folder}", seq_len=64)
    plain = build_task("lm", corpus=f"pystdlib:{folder}", seq_len=64, documents="start")
    assert task.name == "code_lm" and task.options()["documents"] == "start"
    for split in ("train", "test"):
        assert torch.equal(task.fixed_sample(split, 3)[0], plain.fixed_sample(split, 3)[0])
    assert task.baselines() == plain.baselines()
    from routeformer.tasks.registry import task_options
    defaults = task_options("code_lm")
    assert (defaults["corpus"], defaults["seq_len"], defaults["documents"]) == ("pystdlib", 4096, "start")
