"""The meta-tokens experiments at toy size: they run, share their runs, and report
what they measured (accuracies at 1x and 2x, chance and floors, parameters)."""

import json

import pytest
import torch

import routeformer.experiments.meta_tokens_recall as recall
from routeformer.experiments.meta_tokens_runs import RecallRun, build_model, load_body, positions_of
from routeformer.experiments.registry import _EXPERIMENTS


def tiny(quick):
    return recall.Settings(("copying",), (0, 1), 2, (2,), validation_sequences=8, test_sequences=8)


def test_experiments_run_at_toy_size_and_share_their_runs(tmp_path, monkeypatch):
    # (the registry as filled by importing this module; list_experiments imports every module)
    assert {"meta-tokens-recall", "meta-tokens-ablations", "meta-tokens-finetune"} <= set(_EXPERIMENTS)
    monkeypatch.setattr(recall, "settings", tiny)
    reports = {}
    for name, run in (("recall", recall.run_recall), ("ablations", recall.run_ablations),
                      ("finetune", recall.run_finetune)):
        out = tmp_path / name
        out.mkdir()
        reports[name] = run(out, True).read_text()
    runs = sorted(p.stem for p in (tmp_path / "meta-tokens-runs" / "runs").glob("*.json"))
    # recall: 3 variants x 2 seeds; ablations adds keep, zero, parallel and zeroed pause (its skip
    # row is shared); finetune adds 2 pre-trainings and 2 fine-tuned variants x 2 seeds (its scratch
    # rows are shared).
    assert len(runs) == 6 + 8 + 2 + 4, runs
    assert "test 2×" in reports["recall"] and "shortcut floor" in reports["recall"]
    assert "zeroed" in reports["ablations"] and "pre-trained" in reports["finetune"]
    result = json.loads((tmp_path / "recall" / "result.json").read_text())["results"]["copying"]
    for label, stats in result.items():
        if label == "floors":
            assert 0 < stats["1x"]["chance"] <= stats["1x"]["floor"] <= 1
            continue
        assert len(stats["test_2x"]["values"]) == 2
        assert all(0 <= v <= 1 for v in stats["test_1x"]["values"] + stats["test_2x"]["values"])


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
