"""`routeformer bench steps`: a whole model's training step against full's, in the same rounds."""

import json

import pytest

from routeformer.bench.model_steps import model_step_rows
from routeformer.cli import main
from routeformer.compare.budgets import options_for
from routeformer.train.on_task import ModelSpec

SPEC = ModelSpec(dim=16, depth=1, heads=2, mlp_ratio=2.0, positions="rotary")


def test_rows_time_every_mechanism_against_full_with_the_same_tokens_per_step():
    rows = model_step_rows(["topk", "full"], [32, 64], options_for=options_for, spec=SPEC, tokens=128,
                           repeats=2)
    assert [(r["seq_len"], r["mechanism"]) for r in rows] == [(32, "full"), (32, "topk"), (64, "full"),
                                                               (64, "topk")]
    assert [r["batch"] for r in rows] == [4, 4, 2, 2]  # 128 tokens a step at every length
    for row in rows:
        assert row["ms_per_step"] > 0
        low, high = row["vs_full_quartiles"]
        assert low <= row["vs_full"] <= high
    assert all(r["vs_full"] == 1.0 for r in rows if r["mechanism"] == "full")
    assert rows[1]["options"] == {"topk": 4}  # compare's budget at T=32


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="mechanisms"):
        model_step_rows([], [32], options_for=options_for, spec=SPEC)
    with pytest.raises(ValueError, match="tokens"):
        model_step_rows(["topk"], [64], options_for=options_for, spec=SPEC, tokens=32)


def test_cli_writes_the_table_and_refuses_unknown_mechanisms(tmp_path, capsys):
    assert main(["bench", "steps", "--mechanisms", "nope", "--lengths", "32"]) == 2
    assert "nope" in capsys.readouterr().err
    out = tmp_path / "steps.md"
    assert main(["bench", "steps", "--mechanisms", "linear", "--lengths", "32", "--tokens", "64",
                 "--repeats", "1", "--output", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["mechanism"] for r in data["rows"]] == ["full", "linear"]
    assert "| 32 | 2 | linear |" in out.read_text()


def test_cli_times_meta_hard_routed_at_given_shares(tmp_path):
    out = tmp_path / "steps.md"
    assert main(["bench", "steps", "--mechanisms", "meta", "--lengths", "64", "--tokens", "64",
                 "--repeats", "1", "--meta-shares", "0.25", "0.75", "0", "--output", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["settings"]["meta_shares"] == [0.25, 0.75, 0.0]
    meta = next(r for r in data["rows"] if r["mechanism"] == "meta")
    assert meta["options"]["train_eta"] == 0.05 and meta["options"]["window"] == 64  # the long recipe
    assert main(["bench", "steps", "--meta-shares", "0.5", "0.5"]) == 2
    assert main(["bench", "steps", "--mechanisms", "meta", "--lengths", "64", "--tokens", "64",
                 "--meta-shares", "0.5", "0.6", "-0.1"]) == 2  # not shares: the layer's ValueError
