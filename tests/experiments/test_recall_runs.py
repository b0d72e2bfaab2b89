"""The recall runs of the meta-tokens reproduction (experiments/recall_runs.py): the variants differ in one
thing, and fine-tuning starts from the pre-trained function."""

import pytest
import torch

from routeformer.experiments.recall_runs import RecallRun, build_model, load_body, positions_of


def test_variants_differ_in_one_thing(tmp_path):
    plain, pause, meta = (RecallRun("copying", {"segments": 2, "segment_length": 2}, variant=v)
                          for v in ("plain", "pause", "meta"))
    counts = {run.variant: sum(p.numel() for p in build_model(run).parameters())
              for run in (plain, pause, meta)}
    assert counts["plain"] == counts["pause"] < counts["meta"]
    drawn = pause.build_task().batch(4, torch.Generator().manual_seed(0))
    inputs, labels = pause.read(*drawn)
    bare, bare_labels = plain.read(*drawn)
    assert torch.equal(inputs[inputs != 1].view(4, -1), bare)  # the same sequences, minus _PAUSE_
    assert torch.equal(labels[inputs != 1].view(4, -1), bare_labels)
    # ... which are what the task without _PAUSE_ generates from the same draw
    generated = plain.build_task(meta=False).generate(4, torch.Generator().manual_seed(3))
    stripped = plain.read(*pause.build_task().generate(4, torch.Generator().manual_seed(3)))
    assert all(torch.equal(a, b) for a, b in zip(stripped, generated, strict=True))
    # skip positions: the real tokens stand where they stand without _PAUSE_
    assert torch.equal(positions_of(pause, inputs)[inputs != 1].view(4, -1), positions_of(plain, bare))
    with pytest.raises(ValueError, match="variant"):
        RecallRun("copying", {}, variant="tokens")


def test_fine_tuning_starts_from_the_pretrained_function(tmp_path):
    """A body saved from `full` loads into the meta model; with the meta output projection at zero
    the meta model computes what the pre-trained body computes on the same embeddings."""
    run = RecallRun("copying", {"segments": 2, "segment_length": 2}, variant="meta")
    source = build_model(RecallRun("copying", {"segments": 2, "segment_length": 2}, variant="pause", seed=5))
    path = tmp_path / "body.pt"
    torch.save(source.state_dict(), path)
    model = build_model(run)
    load_body(model, str(path))
    model.backbone.token_embedding.load_state_dict(source.backbone.token_embedding.state_dict())
    model.lm_head.load_state_dict(source.lm_head.state_dict())
    inputs, _ = run.build_task().batch(3, torch.Generator().manual_seed(1))
    positions = positions_of(run, inputs)
    torch.testing.assert_close(model.eval()(inputs, positions=positions).logits,
                               source.eval()(inputs, positions=positions).logits)
