"""The seed orders of runner/seeds.py: the order given, seed-major or variant-major, and repeats
or wrong types refused before anything runs."""

import pytest

from routeformer.runner.seeds import checked_seeds, over_seeds, seed_grid, seed_sweep


def test_over_seeds_calls_fn_once_per_seed_in_the_given_order():
    calls = []
    assert over_seeds(lambda seed: calls.append(seed) or seed * 10, (2, 0, 1)) == [20, 0, 10]
    assert calls == [2, 0, 1]


def test_over_seeds_accepts_a_range_and_a_generator():
    assert over_seeds(str, range(3)) == ["0", "1", "2"]
    assert over_seeds(str, (seed for seed in (4, 3))) == ["4", "3"]


def test_empty_seeds_give_no_runs_and_do_not_call_fn():
    def fail(seed):
        raise AssertionError("called")

    assert over_seeds(fail, ()) == []
    assert seed_grid(["a", "b"], []) == []
    assert seed_grid(["a", "b"], [], seed_major=False) == []
    assert seed_sweep(["a"], lambda variant: ()) == []
    assert checked_seeds(range(0)) == ()


def test_seed_grid_seed_major_holds_whole_seeds_in_order():
    assert seed_grid(["a", "b"], (1, 0)) == [("a", 1), ("b", 1), ("a", 0), ("b", 0)]


def test_seed_grid_variant_major_holds_whole_variants_in_order():
    assert seed_grid(["b", "a"], (0, 1), seed_major=False) == [("b", 0), ("b", 1), ("a", 0), ("a", 1)]


def test_seed_grid_takes_unhashable_variants_and_the_keys_of_a_dict():
    variants = [("full", {"k": 1}), ("topk", {"k": 2})]
    assert seed_grid(variants, [0], seed_major=False) == [(variants[0], 0), (variants[1], 0)]
    assert seed_grid({"x": 1, "y": 2}, [3]) == [("x", 3), ("y", 3)]


def test_no_variants_give_no_runs():
    assert seed_grid([], (0, 1)) == []
    assert seed_sweep([], lambda variant: (0,)) == []


def test_seed_sweep_variant_major_takes_each_variant_s_own_seeds_in_their_order():
    seeds = {"a": (2, 0), "b": (1,)}
    assert seed_sweep(["a", "b"], seeds.get, seed_major=False) == [("a", 2), ("a", 0), ("b", 1)]


def test_seed_sweep_seed_major_runs_seeds_ascending_with_the_variants_that_have_them():
    seeds = {"a": (2, 0), "b": (1, 0)}
    assert seed_sweep(["a", "b"], seeds.get) == [("a", 0), ("b", 0), ("b", 1), ("a", 2)]


def test_seed_sweep_with_the_same_seeds_everywhere_is_seed_grid_for_sorted_seeds():
    for seed_major in (True, False):
        assert (seed_sweep(["a", "b", "c"], lambda variant: (0, 1, 2), seed_major=seed_major)
                == seed_grid(["a", "b", "c"], (0, 1, 2), seed_major=seed_major))


@pytest.mark.parametrize("call", [
    lambda: over_seeds(str, (0, 1, 0)),
    lambda: seed_grid(["a"], [3, 3]),
    lambda: seed_sweep(["a"], lambda variant: [1, 1]),
    lambda: checked_seeds([5, 5]),
])
def test_a_repeated_seed_raises_value_error(call):
    with pytest.raises(ValueError, match="repeat"):
        call()


@pytest.mark.parametrize("call", [
    lambda: seed_grid(["a", "b", "a"], [0]),
    lambda: seed_grid([("full", {"k": 1}), ("full", {"k": 1})], [0], seed_major=False),
    lambda: seed_sweep(["a", "a"], lambda variant: [0]),
])
def test_a_repeated_variant_raises_value_error(call):
    with pytest.raises(ValueError, match="variants must not repeat"):
        call()


def test_a_repeated_seed_raises_before_fn_runs():
    calls = []
    with pytest.raises(ValueError):
        over_seeds(calls.append, [1, 2, 1])
    assert calls == []


@pytest.mark.parametrize("seeds", [3, "012", [0, 1.0], [True], [None]])
def test_seeds_that_are_not_ints_raise_type_error(seeds):
    with pytest.raises(TypeError, match="seeds"):
        over_seeds(str, seeds)


def test_variants_that_are_not_an_iterable_raise_type_error():
    with pytest.raises(TypeError, match="variants"):
        seed_grid(3, [0])
    with pytest.raises(TypeError, match="variants"):
        seed_grid("ab", [0])


def test_a_seed_sweep_error_names_the_variant():
    with pytest.raises(ValueError, match=r"seeds_of\('b'\)"):
        seed_sweep(["a", "b"], {"a": (0,), "b": (1, 1)}.get)
