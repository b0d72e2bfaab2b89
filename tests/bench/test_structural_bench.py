"""The structural bench suite's timing of expanding against local (structural-speed reports it)."""

from routeformer.bench.structural_bench import time_against_local


def test_speed_record_times_local_with_expanding_mean_window():
    record = time_against_local(128, 1.0, 9.0, repeats=1, heads=2, head_dim=8, with_multihop=True)
    assert record["mean_window"] >= 1 and record["max_window"] >= record["mean_window"]
    for mode in ("forward", "forward+backward"):
        assert record[mode]["expanding_over_local_median"] > 0
        assert len(record[mode]["expanding_over_local_per_round"]) == 1
        assert record[mode]["multihop_over_sdpa_median"] > 0
