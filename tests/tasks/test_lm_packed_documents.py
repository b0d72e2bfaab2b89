"""Task lm's packed training batches (pack_documents=True): the plain windows, with paragraph ids and
no label across a paragraph boundary; everything else stays plain."""

import pytest
import torch

from routeformer.data.batches import IGNORE_INDEX
from routeformer.tasks import build_task


def _packed_and_plain(batch_size=16, seq_len=64, seed=3):
    packed, plain = build_task("lm", seq_len=seq_len, pack_documents=True), build_task("lm", seq_len=seq_len)
    got = packed.training_batch(batch_size, torch.Generator().manual_seed(seed))
    return packed, got, plain.training_batch(batch_size, torch.Generator().manual_seed(seed))


def test_packed_batches_are_the_plain_windows_with_paragraph_ids():
    task, (inputs, labels, extra), (plain_inputs, plain_labels, plain_extra) = _packed_and_plain()
    assert plain_extra == {} and set(extra) == {"documents"}
    assert torch.equal(inputs, plain_inputs)  # the same draw of windows
    separator = task.vocab.encode("\n\n").tolist()
    assert len(separator) == 2
    # the oracle, read off the window itself: a paragraph starts after each blank line
    starts = (inputs[:, :-2] == separator[0]) & (inputs[:, 1:-1] == separator[1])  # starts at t + 2
    documents = extra["documents"]
    assert torch.equal(documents[:, 2:] - documents[:, 1:-1], starts.long())
    assert bool((documents[:, 0] == 0).all()) and bool((documents.diff(dim=1) >= 0).all())
    # labels: the plain ones, unset where the label is a paragraph's first token (after a blank line)
    unset = labels == IGNORE_INDEX
    assert torch.equal(labels[~unset], plain_labels[~unset])
    label_starts = (inputs[:, :-1] == separator[0]) & (inputs[:, 1:] == separator[1])  # label t + 1
    assert torch.equal(unset[:, 1:], label_starts)
    assert int(unset.sum()) > 0 and int(documents.max()) > 0  # the sample holds boundaries to test


def test_packing_changes_no_other_batch_and_is_named_in_the_options():
    task, plain = build_task("lm", seq_len=64, pack_documents=True), build_task("lm", seq_len=64)
    for split in ("train", "validation", "test"):
        first, second = (t.batch(4, torch.Generator().manual_seed(1), split) for t in (task, plain))
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(task.fixed_sample("test", 4)[0], plain.fixed_sample("test", 4)[0])
    assert task.options() == {"corpus": "pydoc", "seq_len": 64, "pack_documents": True}
    assert "pack_documents" not in plain.options()


@pytest.mark.parametrize("options, message", [
    ({"pack_documents": "yes"}, "pack_documents must be true or false; got 'yes'"),
    ({"pack_documents": True, "meta_density": 0.1}, "pack_documents=True needs documents='stream' and "
                                                     "meta_density=0"),
    ({"pack_documents": True, "corpus": "pystdlib", "documents": "start", "seq_len": 256},
     "pack_documents=True needs documents='stream'"),
])
def test_packing_refuses_what_it_cannot_pack(options, message):
    with pytest.raises(ValueError, match=message):
        build_task("lm", **{"seq_len": 64, **options})
