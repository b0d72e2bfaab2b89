"""`routeformer bench layers --split`: a layer's training step split into projections, routing,
attention, auxiliary losses, backward and other; the parts account for the whole step."""

from types import SimpleNamespace

import pytest

from routeformer.bench.layer_split import PARTS, _exclusive_parts, split_layer_step
from routeformer.cli import main


def _event(name, start, end, sequence=-1):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), sequence_nr=sequence)


def test_nested_ranges_count_once_and_backward_nodes_go_to_their_forward_part():
    node = "autograd::engine::evaluate_function: "
    events = [
        _event("routeformer::forward", 0, 100),  # not a part: its unmarked time is `other`
        _event("routeformer::projections", 0, 10),
        _event("aten::linear", 1, 9, sequence=0),
        _event("routeformer::attention", 10, 60),
        _event("routeformer::routing", 20, 35),  # inside attention: routing, not attention
        _event("aten::topk", 21, 30, sequence=1),
        _event("routeformer::rotary", 40, 45, sequence=2),  # a custom op: not a part, an attention op
        _event("routeformer::projections", 60, 70),
        _event("aten::mean", 80, 85, sequence=3),  # outside every range: other
        _event("routeformer::backward", 100, 190),
        _event(node + "MeanBackward0", 101, 106, sequence=3),
        _event(node + "RotaryBackward", 110, 130, sequence=2),
        _event(node + "TopkBackward0", 130, 140, sequence=1),
        _event(node + "AddmmBackward0", 140, 170, sequence=0),
    ]
    parts = _exclusive_parts(events, total_us=200.0)
    assert parts == {"projections": 20.0 + 30, "routing": 15.0 + 10, "attention": 35.0 + 20, "aux_loss": 0.0,
                     "backward": 90.0 - 65, "other": 40.0 + 5}
    assert sum(parts.values()) == 200.0


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
    medians = row["ms"]  # (a sum of per-part medians is not the median step: no equality asked)
    assert medians["total"] <= max(step["total"] for step in row["steps_ms"])
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
