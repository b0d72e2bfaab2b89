"""The accelerator decode benchmark's plumbing, on the CPU at toy size (the GPU run is a command)."""

import torch

from routeformer.bench.generate_device import decode_rates, format_row


def test_decode_rates_time_every_mechanism_and_report_errors(monkeypatch):
    rows = decode_rates(["full", "local", "topk"], [48], device="cpu", dtype=torch.float32, steps=2,
                        rounds=2, dim=32, heads=2, progress=lambda _: None)
    assert [(r["mechanism"], r["context"]) for r in rows] == [("full", 48), ("local", 48), ("topk", 48)]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
        assert format_row(row).startswith(f"| {row['mechanism']} | 48 |")
    assert rows[0]["speedup_vs_full"] == 1.0
    broken = decode_rates(["full", "nonexistent"], [16], device="cpu", dtype=torch.float32, steps=1,
                          rounds=1, dim=32, heads=2, progress=lambda _: None)
    assert "error" in broken[1] and "error:" in format_row(broken[1])
