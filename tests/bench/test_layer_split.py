"""`routeformer bench layers --split`: a layer's training step split into projections, routing,
attention, auxiliary losses, backward and other; the parts account for the whole step."""

from types import SimpleNamespace

import pytest

from routeformer.bench.layer_split import PARTS, _exclusive_parts, split_layer_step
from routeformer.cli import main


def _event(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_nested_ranges_count_once_for_their_innermost_part():
    events = [
        _event("routeformer::forward", 0, 100),  # not a part: its unmarked time is `other`
        _event("routeformer::projections", 0, 10),
        _event("routeformer::attention", 10, 60),
        _event("routeformer::routing", 20, 35),  # inside attention: routing, not attention
        _event("routeformer::rotary", 40, 45),  # a custom op of the same namespace: not a part
        _event("routeformer::projections", 60, 70),
        _event("routeformer::backward", 100, 190),
    ]
    parts = _exclusive_parts(events, total_us=200.0)
    assert parts == {"projections": 20.0, "routing": 15.0, "attention": 35.0, "aux_loss": 0.0,
                     "backward": 90.0, "other": 40.0}


@pytest.mark.parametrize(("mechanism", "options"), [
    ("mita", {"landmarks": 4, "topk": 8, "block": 16}),
    ("full", {}),
    ("local", {"window": 16}),
])
def test_parts_sum_to_the_step(mechanism, options):
    row = split_layer_step(mechanism, 96, repeats=3, dim=32, heads=2, options=options)
    for step in row["steps_ms"]:  # every step: no part negative, the parts are the step
        assert all(step[part] >= 0 for part in PARTS), step
        assert sum(step[part] for part in PARTS) == pytest.approx(step["total"], rel=1e-9)
    medians = row["ms"]
    assert sum(medians[part] for part in PARTS) == pytest.approx(medians["total"], rel=0.25)
    assert medians["projections"] > 0 and medians["attention"] > 0 and medians["backward"] > 0
    assert (medians["routing"] > 0) == (mechanism == "mita")


def test_an_unknown_mechanism_is_a_value_error_and_exit_status_2(capsys):
    with pytest.raises(ValueError, match="unknown 'nope'; registered: .*mita"):
        split_layer_step("nope", 32, repeats=1)
    assert main(["bench", "layers", "--split", "--lengths", "32", "--mechanisms", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("routeformer: error: --mechanisms: unknown ['nope']") and err.count("\n") == 1


def test_the_split_table_is_written(tmp_path):
    output = tmp_path / "split.md"
    assert main(["bench", "layers", "--split", "--lengths", "64", "--repeats", "1", "--mechanisms", "mita",
                 "--output", str(output)]) == 0
    text = output.read_text()
    assert "| 64 | full | " in text and "| 64 | mita | " in text and "routing ms" in text
