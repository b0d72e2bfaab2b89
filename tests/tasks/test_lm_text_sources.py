"""Task lm on a local text file or folder (`path`, as a training config's `data.path`) and with a BPE
tokeniser (`tokenizer`, as `data.tokenizer`): the task reads the ids of the corpus loader
(`data.corpora.load_data`), tokeniser and token cache, and draws its training windows with
`lm_windows`; its held-out ids are the corpus's held-out text, halved. The default options leave
the task as it was: its description, ids, batches and baselines are pinned below."""

import random

import pytest
import torch

from routeformer.data.corpora import load_data
from routeformer.data.token_cache import encode_cached
from routeformer.data.tokenizers import BPETokenizer, build_tokenizer, tokenizer_from_dict
from routeformer.tasks import build_task
from routeformer.tasks.lm import lm_windows
from tests.data.test_tokenizers import train_bpe

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "pack", "my", "box", "with",
         "five", "dozen", "liquor", "jugs", "sphinx", "of", "black", "quartz", "judge", "vow")


def text_file(path, words: int = 1200, seed: int = 0):
    """A few KB of seeded random sentences written to `path` (returned as a string)."""
    chooser = random.Random(seed)
    lines = [" ".join(chooser.choice(WORDS) for _ in range(chooser.randint(4, 11))) + "."
             for _ in range(words // 7)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def loader_ids(path, tokenizer="char"):
    """(tokeniser, training ids, held-out ids) of the text at `path`, read by the loader."""
    corpus = load_data("pydoc", path)
    vocab = build_tokenizer(tokenizer, corpus.train)
    return vocab, encode_cached(vocab, corpus.train), encode_cached(vocab, corpus.val)


def assert_reads_the_loaders_ids(task, path, tokenizer="char"):
    vocab, train_ids, val_ids = loader_ids(path, tokenizer)
    assert task.vocab.to_dict() == vocab.to_dict() and task.vocab_size == len(vocab)
    assert torch.equal(task.ids("train"), train_ids)
    assert torch.equal(torch.cat([task.ids("validation"), task.ids("test")]), val_ids)
    assert len(task.ids("validation")) == len(val_ids) // 2
    batch = task.batch(8, torch.Generator().manual_seed(4))
    expected = lm_windows(train_ids, 8, task.seq_len, torch.Generator().manual_seed(4))
    assert all(torch.equal(got, want) for got, want in zip(batch, expected, strict=True))


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", str(tmp_path / "cache"))


def test_the_default_options_leave_the_task_as_it_was():
    task = build_task("lm", seq_len=32)
    assert task.describe() == "lm(corpus=pydoc, seq_len=32)" and task.options() == {"corpus": "pydoc",
                                                                                       "seq_len": 32}
    assert task.vocab_size == 105 and [len(task.ids(s)) for s in ("train", "validation", "test")] == [
        418613, 23256, 23257]
    inputs, labels = task.batch(4, torch.Generator().manual_seed(0))
    assert task.vocab.decode(inputs[0]) == "tion can access the local variab"
    assert (int(inputs.sum()), int(labels.sum())) == (7035, 7051)
    fixed, _ = task.fixed_sample("test", 2)
    assert task.vocab.decode(fixed[1]) == "   |\n|                          "
    assert task.baselines() == {"unigram (bits/char)": 4.600347500706515,
                                "bigram (bits/char)": 3.2670581355106343}
    assert task.path is None and task.tokenizer == "char"


def test_a_local_file_gives_the_ids_the_lm_run_reads(tmp_path):
    path = text_file(tmp_path / "notes.txt")
    task = build_task("lm", path=path, seq_len=16)
    assert task.describe() == f"lm(corpus=pydoc, seq_len=16, path={path})"
    assert task.corpus_name == f"path:{path}"
    assert_reads_the_loaders_ids(task, path)
    # the file's characters, not pydoc's: a different vocabulary
    assert task.vocab.to_dict() != build_task("lm", seq_len=16).vocab.to_dict()


def test_a_folder_of_splits_gives_the_ids_the_lm_run_reads(tmp_path):
    folder = tmp_path / "splits"
    folder.mkdir()
    text_file(folder / "train.txt", seed=1)
    text_file(folder / "valid.txt", words=300, seed=2)
    task = build_task("lm", path=str(folder), seq_len=16, meta_density=0.1)
    vocab, train_ids, val_ids = loader_ids(str(folder))
    assert task.vocab.to_dict() == vocab.to_dict() and torch.equal(task.ids("train"), train_ids)
    assert torch.equal(torch.cat([task.ids("validation"), task.ids("test")]), val_ids)
    assert task.meta_token_id == task.vocab.pause_id
    assert "valid.txt" in task.corpus_name


def test_a_rewritten_file_is_read_again(tmp_path):
    path = text_file(tmp_path / "notes.txt", seed=0)
    before = build_task("lm", path=path, seq_len=16).ids("train")
    text_file(tmp_path / "notes.txt", words=1400, seed=5)
    after = build_task("lm", path=path, seq_len=16)
    assert not torch.equal(before, after.ids("train"))
    assert_reads_the_loaders_ids(after, path)


def test_a_bpe_tokenizer_gives_the_ids_the_lm_run_reads(tmp_path):
    pytest.importorskip("tokenizers")
    train_bpe(tmp_path / "tokenizer.json")
    path = text_file(tmp_path / "notes.txt")
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):  # the file or its folder
        task = build_task("lm", path=path, tokenizer=spec, seq_len=16)
        assert isinstance(task.vocab, BPETokenizer)
        assert task.options() == {"corpus": "pydoc", "seq_len": 16, "path": path, "tokenizer": spec}
        assert_reads_the_loaders_ids(task, path, spec)
        assert len(task.ids("train")) < len(load_data("pydoc", path).train) / 2  # merged tokens
        saved = tokenizer_from_dict(task.vocab.to_dict())  # what a run directory keeps
        inputs, _ = task.fixed_sample("validation", 2)
        assert saved.decode(inputs[0]) == task.vocab.decode(inputs[0])
    # a corpus spec with BPE tokens; meta-tokens get the added _PAUSE_ id
    spec_task = build_task("lm", seq_len=16, tokenizer=str(tmp_path), meta_density=0.2)
    assert spec_task.meta_token_id == spec_task.vocab.pause_id == len(spec_task.vocab) - 1
    assert torch.equal(spec_task.ids("train"), loader_ids(None, str(tmp_path))[1])
    assert set(spec_task.baselines()) == {"unigram (bits/char)", "bigram (bits/char)"}
    assert all(value > 0 for value in spec_task.baselines().values())


def test_the_sparse_bigram_is_the_add_one_table():
    task = build_task("lm", seq_len=32)
    train, size = task.ids("train"), task.vocab_size
    pairs = torch.bincount(train[:-1] * size + train[1:], minlength=size * size).double().view(size, size) + 1
    table = pairs / pairs.sum(1, keepdim=True)
    previous, target = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    assert torch.equal(task._bigram_probability(previous, target), table)


BAD = [
    ({"path": ""}, "path must be None or a local text file or folder"),
    ({"path": 3}, "path must be None or a local text file or folder"),
    ({"path": "MISSING"}, "path 'MISSING' is neither a file nor a folder"),
    ({"path": "EMPTY"}, "path 'EMPTY' holds no text files"),
    ({"tokenizer": ""}, "tokenizer must be 'char' or a path to a tokenizer.json"),
    ({"tokenizer": None}, "tokenizer must be 'char' or a path to a tokenizer.json"),
    ({"tokenizer": "MISSING"}, "tokenizer must be 'char', a tokenizer.json file or a Hugging Face"),
    ({"tokenizer": "EMPTY"}, "tokenizer must be 'char', a tokenizer.json file .*has no tokenizer.json"),
    ({"path": "FILE", "documents": "start"}, "path='FILE' needs documents='stream'"),
    ({"tokenizer": "EMPTY", "documents": "start"}, "tokenizer='EMPTY' needs documents='stream'"),
    ({"path": "SHORT"}, "seq_len=16 is longer than the validation text of path 'SHORT'"),
]


@pytest.mark.parametrize(("options", "message"), BAD, ids=[str(options) for options, _ in BAD])
def test_bad_text_options_are_refused_naming_the_option(tmp_path, options, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "short.txt").write_text("x" * 120)
    names = {"MISSING": str(tmp_path / "missing"), "EMPTY": str(tmp_path / "empty"),
             "FILE": text_file(tmp_path / "notes.txt"), "SHORT": str(tmp_path / "short.txt")}
    options = {key: names.get(value, value) if isinstance(value, str) else value
               for key, value in options.items()}
    for name, value in names.items():
        message = message.replace(name, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_task("lm", seq_len=16, **options)
