"""The `pystdlib` corpus: Python standard-library files as documents, three file-disjoint splits."""

import json

import pytest

from routeformer.data import CharVocab, load_corpus
from routeformer.data.corpora import data_dirs


def write_pystdlib(folder, splits):
    """A tiny pystdlib folder: splits maps train/valid/test to lists of (path, text)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, documents in splits.items():
        lines = [json.dumps({"path": path, "text": text}) for path, text in documents]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_a_local_pystdlib_folder_keeps_its_documents(tmp_path):
    folder = write_pystdlib(tmp_path / "py", {"train": [("a.py", "x = 1\n"), ("b.py", "y = 2\n")],
                                              "valid": [("c.py", "z = 3\n")], "test": [("d.py", "w = 4\n")]})
    corpus = load_corpus(f"pystdlib:{folder}")
    assert corpus.documents == {"train": ["x = 1\n", "y = 2\n"], "validation": ["z = 3\n"],
                                "test": ["w = 4\n"]}
    assert corpus.document_paths["train"] == ["a.py", "b.py"]
    assert (corpus.train, corpus.val, corpus.test) == ("x = 1\ny = 2\n", "z = 3\n", "w = 4\n")


def test_missing_or_malformed_pystdlib_is_a_value_error_saying_how_to_supply_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./data or ../shared/data here
    monkeypatch.delenv("ROUTEFORMER_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match=r"corpus 'pystdlib' not found .*python-stdlib.*pystdlib:DIR.*"
                                         r"ROUTEFORMER_DATA_DIR"):
        load_corpus("pystdlib")
    with pytest.raises(ValueError, match=r"nowhere.*train.jsonl' does not exist"):
        load_corpus(f"pystdlib:{tmp_path / 'nowhere'}")
    folder = write_pystdlib(tmp_path / "bad", {"train": [("a.py", "a\n")], "valid": [("b.py", "b\n")],
                                               "test": [("c.py", "c\n")]})
    (folder / "valid.jsonl").write_text('{"path": "b.py"}\n')
    with pytest.raises(ValueError, match=r"valid.jsonl' line 1 is not a JSON object with 'path' and 'text'"):
        load_corpus(f"pystdlib:{folder}")
    monkeypatch.setenv("ROUTEFORMER_DATA_DIR", str(tmp_path / "env"))
    write_pystdlib(tmp_path / "env" / "python-stdlib",
                   {"train": [("a.py", "a\n")], "valid": [("b.py", "b\n")], "test": [("c.py", "c\n")]})
    assert load_corpus("pystdlib").test == "c\n"  # found through $ROUTEFORMER_DATA_DIR


def test_shared_pystdlib_loads_with_disjoint_files_and_a_covering_vocabulary():
    if not any((d / "python-stdlib/train.jsonl").exists() for d in data_dirs()):
        pytest.skip("../shared/data/python-stdlib is not beside the repository")
    corpus = load_corpus("pystdlib")
    counts = {split: len(documents) for split, documents in corpus.documents.items()}
    assert counts == {"train": 553, "validation": 32, "test": 29}
    paths = {split: set(names) for split, names in corpus.document_paths.items()}
    assert sum(len(names) for names in paths.values()) == 614  # no file twice, in a split or across
    assert not paths["train"] & paths["validation"] and not paths["train"] & paths["test"]
    assert not paths["validation"] & paths["test"]
    assert corpus.train == "".join(corpus.documents["train"]) and len(corpus.train) == 10_303_044
    vocab = CharVocab.from_text(corpus.train)  # as the lm task builds it
    assert all(ord(c) < 128 for c in vocab.tokens[len(vocab.specials):])
    for held_out in (corpus.val, corpus.test):
        assert set(held_out) <= set(corpus.train)  # no <unk> in validation or test
