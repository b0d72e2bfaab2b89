"""Meta-token injection, loss masking and the reserved `_PAUSE_` id."""

import pytest
import torch

from routeformer.data.vocab import PAUSE, CharVocab
from routeformer.tasks.meta_tokens import inject_meta_tokens, meta_count, real_tokens_per_window

META = 0


def windows(seq_len, density, batch=4):
    real = real_tokens_per_window(seq_len, density) + 1
    return torch.arange(1, batch * real + 1).view(batch, real)


def test_injection_keeps_real_tokens_in_order_and_masks_meta_targets():
    seq_len, density = 50, 0.1
    source = windows(seq_len, density)
    inputs, labels = inject_meta_tokens(source, seq_len, meta_id=META, density=density,
                                        generator=torch.Generator().manual_seed(0))
    assert inputs.shape == labels.shape == (4, seq_len)
    assert meta_count(seq_len, density) == 5
    assert ((inputs == META).sum(1) == 5).all()
    for row in range(4):
        torch.testing.assert_close(inputs[row][inputs[row] != META], source[row, :-1])
        stream = torch.cat([inputs[row], source[row, -1:]])
        expected = torch.where(stream[1:] == META, -100, stream[1:])
        torch.testing.assert_close(labels[row], expected)
    # Each real token is a target at most once, and none of the meta-tokens is.
    targets = labels[labels != -100].tolist()
    assert len(targets) == len(set(targets)) and META not in targets


def test_injection_is_seeded_and_differs_per_sequence():
    source = windows(40, 0.2)
    a, b = (inject_meta_tokens(source, 40, meta_id=META, density=0.2,
                               generator=torch.Generator().manual_seed(3))[0] for _ in range(2))
    torch.testing.assert_close(a, b)
    assert not torch.equal(a[0] == META, a[1] == META)


def test_zero_density_is_the_plain_window():
    source = windows(16, 0.0)
    inputs, labels = inject_meta_tokens(source, 16, meta_id=META, density=0.0)
    torch.testing.assert_close(inputs, source[:, :-1])
    torch.testing.assert_close(labels, source[:, 1:])


def test_bad_injection_arguments_are_rejected():
    with pytest.raises(ValueError, match="density"):
        meta_count(10, 1.0)
    with pytest.raises(ValueError, match="windows must have shape"):
        inject_meta_tokens(torch.ones(2, 12, dtype=torch.long), 10, meta_id=META, density=0.1)
    source = windows(20, 0.1)
    source[0, 0] = META
    with pytest.raises(ValueError, match="already contain"):
        inject_meta_tokens(source, 20, meta_id=META, density=0.1)


def test_char_vocab_reserves_pause_and_old_vocabularies_keep_their_ids():
    vocab = CharVocab.from_text("hello")
    assert vocab.tokens[vocab.pause_id] == PAUSE
    assert vocab.pause_id not in vocab.encode("_PAUSE_ hello").tolist()
    assert CharVocab.from_dict(vocab.to_dict()).tokens == vocab.tokens
    old = CharVocab.from_dict({"tokens": ["<unk>", "e", "h", "l", "o"]})  # saved before _PAUSE_
    assert old.encode("hello").tolist() == [2, 1, 3, 3, 4]
    with pytest.raises(ValueError, match="_PAUSE_"):
        _ = old.pause_id


def test_task_vocabularies_reserve_a_pause_id_their_data_never_uses():
    from routeformer.tasks import build_task, listops
    from routeformer.tasks import recall_sequences as recall_tasks

    mqar = build_task("mqar", seq_len=64, pairs=8, vocab_size=64)
    inputs, _ = mqar.batch(8, torch.Generator().manual_seed(0))
    assert int(inputs.max()) < mqar.vocab_size  # id vocab_size is free for a meta-token
    examples = listops.generate_listops(4, listops.ListOpsConfig(min_length=10, max_length=60), seed=0)
    assert all(listops.PAUSE not in tokens for tokens, _ in examples)
    assert listops.VOCAB_SIZE_WITH_PAUSE == listops.PAUSE + 1
    assert recall_tasks.SPECIAL_NAMES[recall_tasks.PAUSE] == PAUSE
