import sys
import types

import pytest
import torch

from routeformer.data import CharVocab, load_corpus, random_batch, sequential_batches
from routeformer.data.corpora import data_dirs


def test_embedded_corpus_is_cpython_help_text_split_90_10():
    corpus = load_corpus("pydoc")
    total = len(corpus.train) + len(corpus.val)
    assert total > 400_000
    assert abs(len(corpus.train) / total - 0.9) < 1e-3
    assert "assert" in corpus.train


def test_text_corpus_and_errors(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 20)
    corpus = load_corpus(f"text:{path}")
    assert corpus.train + corpus.val == "abcdefghij" * 20
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(f"text:{tmp_path / 'missing.txt'}")
    with pytest.raises(ValueError, match="unknown corpus 'nope'.*pydoc"):
        load_corpus("nope")


def test_shared_tinyshakespeare_and_wikitext_load_when_present():
    if not any((d / "tinyshakespeare/input.txt").exists() for d in data_dirs()):
        pytest.skip("../shared/data is not beside the repository")
    assert "ROMEO" in load_corpus("tinyshakespeare").train
    wikitext = load_corpus("wikitext2")
    assert "trained on valid" in wikitext.name and " @-@ " in wikitext.train


def test_wikitext_hub_loader_is_used_without_a_local_copy(monkeypatch, tmp_path):
    calls = []
    fake = types.ModuleType("datasets")

    def load_dataset(name, config):
        calls.append((name, config))
        return {"train": {"text": [" = A = \n", "train text \n"] * 10},
                "validation": {"text": ["valid text \n"] * 20}}

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.chdir(tmp_path)  # no ./data or ../shared/data here
    monkeypatch.delenv("ROUTEFORMER_DATA_DIR", raising=False)
    corpus = load_corpus("wikitext2")
    assert calls == [("wikitext", "wikitext-2-v1")]
    assert corpus.train.startswith(" = A = \n") and "valid text" in corpus.val


def test_vocab_maps_unseen_characters_to_unknown_and_round_trips():
    vocab = CharVocab.from_text("hello world")
    ids = vocab.encode("hold€")
    assert ids[-1].item() == vocab.unknown_id == 0
    assert vocab.decode(vocab.encode("hello")) == "hello"
    again = CharVocab.from_dict(vocab.to_dict())
    assert again.tokens == vocab.tokens


def test_random_batch_labels_are_inputs_shifted():
    ids = torch.arange(100)
    inputs, labels = random_batch(ids, 4, 10, torch.Generator().manual_seed(0))
    assert torch.equal(labels, inputs + 1)
    with pytest.raises(ValueError, match="seq_len=200"):
        random_batch(ids, 4, 200, torch.Generator())


def test_sequential_batches_cover_the_text_once():
    ids = torch.arange(101)
    seen = torch.cat([inputs.flatten() for inputs, _ in sequential_batches(ids, 3, 10)])
    assert torch.equal(seen, torch.arange(100))
