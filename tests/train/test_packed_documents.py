"""`routeformer train` with data.pack_documents: windows carry paragraph ids."""

from __future__ import annotations

import pytest
import torch

from routeformer.data.batches import random_batch
from routeformer.data.documents import document_starts, packed_random_batch
from routeformer.data.vocab import CharVocab
from routeformer.models.heads import TokenPredictor
from routeformer.train import load_config, train
from tests.train.runs import quick_config


def test_packed_batches_are_the_plain_windows_with_document_ids():
    text = "ab cd\n\nefg hi\n\nj\n\nklm nop qrs\n\ntu"
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    starts = document_starts(ids, vocab.encode("\n\n"))
    assert [i for i in range(len(ids)) if starts[i]] == [0, 7, 15, 18, 31]
    plain = random_batch(ids, 6, 12, torch.Generator().manual_seed(0))
    inputs, labels, documents = packed_random_batch(ids, starts, 6, 12, torch.Generator().manual_seed(0))
    assert torch.equal(inputs, plain[0])
    assert bool((documents[:, 1:] >= documents[:, :-1]).all()) and bool((documents[:, 0] == 0).all())
    window_starts = torch.randint(0, len(ids) - 12, (6,), generator=torch.Generator().manual_seed(0))
    for row, start in enumerate(window_starts.tolist()):
        assert vocab.decode(inputs[row].tolist()) == text[start:start + 12]
        for t in range(1, 12):  # a document begins after a blank line (which may precede the window)
            new_document = start + t >= 2 and text[start + t - 2:start + t] == "\n\n"
            assert bool(documents[row, t] != documents[row, t - 1]) == new_document, (row, t)
        # The label is dropped exactly where the next token begins a document.
        next_starts = [bool(documents[row, t + 1] != documents[row, t]) for t in range(11)]
        for t, starts_next in enumerate(next_starts):
            assert (int(labels[row, t]) == -100) == starts_next
            if not starts_next:
                assert int(labels[row, t]) == int(plain[1][row, t])


def test_training_run_with_packed_documents(tmp_path, monkeypatch):
    seen = []
    forward = TokenPredictor.forward

    def spy(self, tokens, labels=None, **kwargs):
        seen.append(kwargs.get("documents"))
        return forward(self, tokens, labels, **kwargs)

    monkeypatch.setattr(TokenPredictor, "forward", spy)
    config = quick_config(tmp_path / "packed", "--steps", "4", "--eval_every", "100", "--eval_tokens", "256",
                          "--final_eval_tokens", "256", "--data.pack_documents", "true",
                          "--model.attention", "[local, full]")
    assert config.data.pack_documents is True
    result = train(config, quiet=True)
    assert result.step == 4
    batches = [d for d in seen if d is not None]
    assert len(batches) == 4  # every training step, not the (plain-window) evaluation
    assert all(d.shape == (8, 32) and d.dtype == torch.long for d in batches)
    assert any(int(d.max()) > 0 for d in batches), "some window must cross a paragraph boundary"

    seen.clear()  # off by default: the plain path, no document ids passed
    plain = quick_config(tmp_path / "plain", "--steps", "2", "--eval_every", "100",
                         "--final_eval_tokens", "256")
    assert plain.data.pack_documents is False
    train(plain, quiet=True)
    assert seen and all(d is None for d in seen)


def test_packing_refuses_meta_tokens():
    with pytest.raises(ValueError, match="pack_documents"):
        load_config(None, ["--data.pack_documents", "true", "--data.meta_density", "0.2"])
