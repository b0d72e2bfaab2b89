"""bench ops' matmul peak: a dtype's peak is never below fp32's, and a row over it is flagged."""

from routeformer.bench.ops_suite import SuiteRow, dtype_peaks, format_row, percent_of_peak


def test_a_dtype_peak_is_the_faster_of_its_matmul_and_fp32s():
    # A CPU without bf16 instructions: its bf16 matmul is far slower than its fp32 units.
    assert dtype_peaks({"fp32": 200.0, "bf16": 1.0}) == {"fp32": 200.0, "bf16": 200.0}
    # A CPU with them: bf16 keeps its own, higher peak.
    assert dtype_peaks({"fp32": 200.0, "bf16": 900.0}) == {"fp32": 200.0, "bf16": 900.0}


def test_a_fraction_over_peak_is_reported_as_a_measuring_error():
    assert percent_of_peak(0.47) == "47%"
    assert percent_of_peak(None) == "–"
    assert percent_of_peak(31.77) == "over peak (3177%): measuring error"


def test_format_row_flags_an_impossible_row():
    row = SuiteRow(length=4096, dtype="bf16", op="topk", forward_ms=10.0, forward_backward_ms=30.0,
                   forward_vs_sdpa=2.0, forward_backward_vs_sdpa=3.0, forward_vs_flex=None,
                   bf16_speedup_forward=1.0, bf16_speedup_forward_backward=1.0, forward_gflop=1.0,
                   forward_gflops_per_s=100.0, forward_peak_fraction=31.77,
                   forward_backward_peak_fraction=0.5, forward_peak_mib=1.0, forward_backward_peak_mib=2.0)
    cells = format_row(row)
    assert "over peak (3177%): measuring error" in cells and "| 50% |" in cells
    assert "3177% |" not in cells.replace("over peak (3177%)", "")
