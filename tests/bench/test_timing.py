"""The timing helpers every benchmark uses: rounds alternate their order, ratios are per round."""

import pytest

from routeformer.bench.timing import median_times, ratio_quartiles, round_times


def test_round_times_reverses_the_order_every_other_round():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = round_times(fns, repeats=3, warmup=1)
    # warm-up round (dropped from the times), then three timed rounds
    assert calls == list("abc" "cba" "abc" "cba")
    assert {name: len(values) for name, values in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert set(median_times(fns, repeats=3)) == {"a", "b", "c"}


def test_ratio_quartiles_pairs_rounds():
    # Each round's two times drift together; the per-round ratio is exactly 2 throughout.
    slow, fast = [2.0, 4.0, 8.0, 16.0, 32.0], [1.0, 2.0, 4.0, 8.0, 16.0]
    assert ratio_quartiles(slow, fast) == pytest.approx((2.0, 2.0, 2.0))
    low, median, high = ratio_quartiles([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5)
    assert (low, median, high) == pytest.approx((1.5, 3.0, 4.5)) and low < median < high
    assert ratio_quartiles([3.0], [2.0]) == (1.5, 1.5, 1.5)
    with pytest.raises(ValueError):
        ratio_quartiles([1.0, 2.0], [1.0])
