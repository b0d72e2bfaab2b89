"""`TaskSetup`'s evaluation steps: `evals` evenly spaced evaluations per stage, or every
`eval_every` steps (and at the stage's end) where it is set; `as_dict` leaves `eval_every` out at its
default so earlier setups read as they did; bad values are refused naming the field."""

import pytest

from routeformer.runner.setups import TaskSetup
from routeformer.train.schedule import Schedule

SCHEDULE = Schedule(steps=10, batch_size=4, lr=1e-3, warmup_steps=1)


def test_eval_every_replaces_the_evenly_spaced_evaluations_where_set():
    assert TaskSetup({}, SCHEDULE, evals=2).eval_every_in(10) == 5
    assert TaskSetup({}, SCHEDULE, evals=20).eval_every_in(10) == 1  # at least every step
    assert TaskSetup({}, SCHEDULE, evals=2, eval_every=3).eval_every_in(10) == 3


def test_as_dict_names_eval_every_only_where_it_is_set():
    assert "eval_every" not in TaskSetup({}, SCHEDULE).as_dict()
    assert TaskSetup({}, SCHEDULE, eval_every=3).as_dict()["eval_every"] == 3


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_a_bad_eval_every_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"^eval_every must be an integer >= 0 \(0: evals evenly spaced\)"):
        TaskSetup({}, SCHEDULE, eval_every=value)
