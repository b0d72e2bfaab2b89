"""Tokenisers (characters, BPE from a tokenizer.json) and the on-disk cache of tokenised corpora."""

import json

import pytest
import torch

from routeformer.data.corpora import Corpus
from routeformer.data.token_cache import cache_dir, encode_cached
from routeformer.data.tokenizers import BPETokenizer, build_tokenizer, tokenizer_from_dict
from routeformer.data.vocab import PAUSE, CharVocab

tokenizers = pytest.importorskip("tokenizers")

TEXT = ("The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n" * 40
        + "Sphinx of black quartz, judge my vow.\n" * 40)


def train_bpe(path, vocab_size: int = 320):
    """A small byte-level BPE model (GPT-2's kind) trained on TEXT and saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT], trainer)
    tokenizer.save(str(path))
    return tokenizer


def test_bpe_from_a_file_or_a_directory_encodes_as_tokenizers_does(tmp_path):
    reference = train_bpe(tmp_path / "tokenizer.json")
    for spec in (tmp_path / "tokenizer.json", tmp_path):
        bpe = build_tokenizer(str(spec), "ignored")
        assert isinstance(bpe, BPETokenizer)
        ids = bpe.encode(TEXT)
        assert ids.dtype == torch.long
        assert ids.tolist() == reference.encode(TEXT, add_special_tokens=False).ids
        assert len(ids) < len(TEXT) / 2  # merges happened: fewer tokens than characters
        assert bpe.decode(ids) == TEXT
    # _PAUSE_ (the meta-token) is added as a special token, after the model's own ids.
    assert bpe.pause_id == reference.get_vocab_size() == len(bpe) - 1
    assert bpe.tokenizer.id_to_token(bpe.pause_id) == PAUSE


def test_long_text_is_encoded_in_pieces_with_the_same_ids(tmp_path, monkeypatch):
    from routeformer.data import tokenizers as module

    reference = train_bpe(tmp_path / "tokenizer.json")
    monkeypatch.setattr(module, "_CHUNK_CHARS", 100)  # many pieces, each cut after a newline
    assert BPETokenizer(reference).encode(TEXT).tolist() == reference.encode(TEXT).ids


def test_a_saved_tokenizer_is_rebuilt_from_plain_json(tmp_path):
    train_bpe(tmp_path / "tokenizer.json")
    bpe = build_tokenizer(str(tmp_path / "tokenizer.json"), "")
    saved = json.loads(json.dumps(bpe.to_dict()))  # what a checkpoint stores
    (tmp_path / "tokenizer.json").unlink()  # the checkpoint needs no file
    again = tokenizer_from_dict(saved)
    assert torch.equal(again.encode(TEXT), bpe.encode(TEXT)) and len(again) == len(bpe)
    chars = tokenizer_from_dict(CharVocab.from_text("abc").to_dict())
    assert isinstance(chars, CharVocab) and chars.decode(chars.encode("cab")) == "cab"


def test_char_stays_the_default_and_bad_specs_are_named(tmp_path):
    assert isinstance(build_tokenizer("char", "hello"), CharVocab)
    with pytest.raises(ValueError, match="data.tokenizer .*does not exist"):
        build_tokenizer(str(tmp_path / "nope.json"), "")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        build_tokenizer(str(tmp_path), "")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizers JSON file"):
        build_tokenizer(str(tmp_path / "bad.json"), "")


def test_tokenised_corpora_are_cached_and_memory_mapped(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", str(tmp_path / "cache"))
    vocab = CharVocab.from_text(TEXT)
    calls = []
    original = CharVocab.encode

    def counting(self, text):
        calls.append(len(text))
        return original(self, text)

    monkeypatch.setattr(CharVocab, "encode", counting)
    corpus = Corpus("t", TEXT[:3000], TEXT[3000:])
    first = [encode_cached(vocab, text) for text in (corpus.train, corpus.val)]
    assert len(calls) == 2 and len(list((tmp_path / "cache" / "tokens").glob("*.i64"))) == 2
    second = [encode_cached(vocab, text) for text in (corpus.train, corpus.val)]
    assert len(calls) == 2  # read back, not encoded again
    for text, a, b in zip((corpus.train, corpus.val), first, second, strict=True):
        assert b.dtype == torch.long and torch.equal(a, b) and torch.equal(b, original(vocab, text))
    # Another text or another tokeniser is another entry.
    encode_cached(CharVocab.from_text(TEXT + "~"), corpus.train)
    encode_cached(vocab, corpus.train + "x")
    assert len(calls) == 4 and len(list((tmp_path / "cache" / "tokens").glob("*.i64"))) == 4
    monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", "off")
    assert cache_dir() is None
    encode_cached(vocab, corpus.train)
    assert len(calls) == 5
