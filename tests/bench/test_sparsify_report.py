"""scripts/sparsify_report.py end to end on a tiny dense recall run: topk rows per K, one row for a
mechanism without a budget (mita: no stage 1), the report naming the mechanism and its options."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[2] / "scripts" / "sparsify_report.py"
TINY = ["--train-dense", "mqar", "--dense-steps", "6", "--seq-len", "32", "--option", "pairs=4",
        "--option", "vocab_size=16", "--seeds", "1", "--test-tokens", "512", "--no-timing"]


def _report_main(monkeypatch, argv):
    spec = importlib.util.spec_from_file_location("sparsify_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["sparsify_report.py", *argv])
    module.main()


@pytest.mark.parametrize("mechanism, extra, budgets", [
    ("topk", ["--ks", "4", "8", "--main-k", "4", "--steps", "2", "--layer-option", "routing_positions=none"],
     [4, 8]),
    ("mita", ["--sparse-steps", "2"], [None]),
])
def test_the_report_has_a_row_per_budget(tmp_path, monkeypatch, mechanism, extra, budgets):
    _report_main(monkeypatch, [*TINY, "--mechanism", mechanism, *extra, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mechanism"] == mechanism and [row["topk"] for row in report["rows"]] == budgets
    text = (tmp_path / "report.md").read_text()
    assert text.startswith(f"# {mechanism} conversion of a dense mqar run")
    if mechanism == "topk":
        assert "`routing_positions='none'`" in text and report["stage1_steps"] == 2
    else:
        assert "no stage 1 (mita has no parameters of its own)" in text and report["stage1_steps"] == 0


def test_render_only_rewrites_the_same_report_from_its_json(tmp_path, monkeypatch):
    _report_main(monkeypatch, [*TINY, "--ks", "4", "--main-k", "4", "--steps", "2", "--out", str(tmp_path)])
    written = (tmp_path / "report.md").read_text()
    assert "attention FLOPs / dense at T=32" in written
    (tmp_path / "report.md").unlink()
    _report_main(monkeypatch, ["--render-only", "--out", str(tmp_path)])
    assert (tmp_path / "report.md").read_text() == written
