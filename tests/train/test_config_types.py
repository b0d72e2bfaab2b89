"""Config values are typed by the schema: YAML 1.1 strings like `3e-4` are numbers where a number goes."""

from dataclasses import fields
from typing import Any, Literal

import pytest

from routeformer.train import load_config
from routeformer.train.config import DataConfig, RunConfig
from routeformer.train.config_types import (
    coerce,
    coerce_attention_options,
    coerce_section,
    field_types,
    parse_override,
)


def test_numbers_in_files_and_overrides_follow_the_field_types(tmp_path):
    path = tmp_path / "run.yaml"
    # PyYAML reads 3e-4, 1_000 and 1e3 as strings (YAML 1.1): the schema makes them numbers.
    path.write_text("train: {lr: 3e-4, steps: 1_000, eval_every: 1e3, beta2: .999}\nmodel: {dim: 6.4e1}\n")
    config = load_config(path, ["--train.min_lr_ratio", "1e-1", "--warmup_steps", "2_0", "--out_dir", "010"])
    schedule = config.train.schedule
    assert schedule.lr == 3e-4 and isinstance(schedule.lr, float)
    assert schedule.steps == 1000 and isinstance(schedule.steps, int)
    assert config.train.eval_every == 1000 and config.train.beta2 == 0.999 and config.model.dim == 64
    assert schedule.min_lr_ratio == 0.1 and schedule.warmup_steps == 20
    assert config.out_dir == "010"  # text fields keep the override as typed (YAML would read 8)


def test_checkpoint_configs_and_structured_values_round_trip():
    config = load_config(None, ["--model.attention", "[local, full]", "--model.depth", "2",
                                "--model.attention_options", "{local: {window: 8}}", "--log_stats", "[kl]"])
    assert config.model.attention == ["local", "full"] and config.train.log_stats == ["kl"]
    assert RunConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("override, message", [
    (["--lr", "abc"], "train.lr must be a number (like 3e-4, 0.1 or 1_000); got 'abc'"),
    (["--lr", ".nan"], "train.lr must be a finite number; got nan"),
    (["--steps", "2.5"], "train.steps must be an integer (like 1000, 1_000 or 1e3); got 2.5"),
    (["--steps", "true"], "train.steps must be an integer"),
    (["--model.causal", "3"], "model.causal must be true or false; got 3"),
    (["--model.attention_options", "5"], "attention_options must be a mapping like {local: {window: 64}}"),
    (["--model.attention_options", "{local: 5}"], "model.attention_options.local must be a mapping; got 5"),
    (["--model.attention_options", "{a"], "model.attention_options: cannot read '{a'"),
    (["--model.attention", "{a: 1}"], "model.attention must be a string or a list of strings"),
    (["--log_stats", "kl"], "train.log_stats must be a list like [a, b]; got 'kl'"),
    (["--model.meta_token_id", "x"], "model.meta_token_id must be an integer or null; got 'x'"),
    (["--precision", "fp8"], "train.precision must be one of ('fp32', 'bf16', 'fp16'); got 'fp8'"),
    (["--beta1", "1"], "train.beta1 must be in [0, 1); got 1.0"),
    (["--bogus.key", "1"], "unknown config section 'bogus'"),
    (["--stpes", "3"], "unknown config key 'stpes'"),
])
def test_bad_values_name_the_field_the_value_and_what_is_allowed(override, message):
    with pytest.raises(ValueError) as caught:
        load_config(None, override)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_bad_values_in_a_file_are_reported_like_overrides(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {lr: fast}\n")
    with pytest.raises(ValueError, match="train.lr must be a number .*got 'fast'"):
        load_config(path)
    path.write_text("train: {lr: [1\n")
    with pytest.raises(ValueError, match="bad.yaml' line 2: not valid YAML"):
        load_config(path)
    path.write_text("train: 5\n")
    with pytest.raises(ValueError, match="config section 'train' must be a mapping"):
        load_config(path)


def test_attention_options_read_numeric_text_by_their_defaults_type():
    config = load_config(None, ["--model.attention_options",
                                "{local: {window: 3e1, block: 1_024}, topk: {temperature: 1e-2}}"])
    assert config.model.attention_options == {"local": {"window": 30, "block": 1024},
                                              "topk": {"temperature": 0.01}}
    assert isinstance(config.model.attention_options["local"]["window"], int)
    # Text that is no number is left for the layer, whose error names the option.
    config = load_config(None, ["--model.attention_options", "{local: {window: abc}}"])
    assert config.model.attention_options == {"local": {"window": "abc"}}


# The conversions one by one: each accepted value, its result and its exact type.
ANY_OPTIONS = dict[str, dict[str, Any]]


@pytest.mark.parametrize("value, annotation, expected", [
    (True, bool, True), (False, bool, False),
    (7, int, 7), ("1_000", int, 1000), ("1e3", int, 1000), (64.0, int, 64), (" 12 ", int, 12),
    ("1e20", int, 10**20),
    ("3e-4", float, 3e-4), (".5", float, 0.5), ("1_000", float, 1000.0), (1, float, 1.0), (2.5, float, 2.5),
    ("010", str, "010"), (2024, str, "2024"), (1.5, str, "1.5"),
    (None, int | None, None), ("7", int | None, 7), (5.0, int | None, 5),
    (None, str | None, None), ("x", str | None, "x"), (8, str | None, "8"),
    (5, str | list[str], "5"), (["a", 1], str | list[str], ["a", "1"]), ("a", str | list[str], "a"),
    (3, str | int, "3"), (3, int | str, 3), ("3", int | str, "3"),  # text takes a str member first
    ([], list[str], []), ([1, "b"], list[str], ["1", "b"]),
    ({5: {"window": [1]}}, ANY_OPTIONS, {"5": {"window": [1]}}), ({}, ANY_OPTIONS, {}),
])
def test_each_type_accepts_its_values(value, annotation, expected):
    result = coerce("k", value, annotation)
    assert result == expected and type(result) is type(expected)


def test_any_passes_the_value_through_as_is():
    value = {"a": [1]}
    assert coerce("k", value, Any) is value


@pytest.mark.parametrize("value, annotation, message", [
    ("yes", bool, "k must be true or false; got 'yes'"),
    (1, bool, "k must be true or false; got 1"),
    (None, bool, "k must be true or false; got None"),
    (True, int, "k must be an integer (like 1000, 1_000 or 1e3); got True"),
    (None, int, "k must be an integer (like 1000, 1_000 or 1e3); got None"),
    ([1], int, "k must be an integer (like 1000, 1_000 or 1e3); got [1]"),
    ("2.5", int, "k must be an integer (like 1000, 1_000 or 1e3); got '2.5'"),
    (2.5, int, "k must be an integer (like 1000, 1_000 or 1e3); got 2.5"),
    ("ten", int, "k must be an integer (like 1000, 1_000 or 1e3); got 'ten'"),
    (float("inf"), int, "k must be a finite number; got inf"),
    (True, float, "k must be a number (like 3e-4, 0.1 or 1_000); got True"),
    ("fast", float, "k must be a number (like 3e-4, 0.1 or 1_000); got 'fast'"),
    ({"a": 1}, float, "k must be a number (like 3e-4, 0.1 or 1_000); got {'a': 1}"),
    ("inf", float, "k must be a finite number; got inf"),
    (float("nan"), float, "k must be a finite number; got nan"),
    (True, str, "k must be a string; got True"),
    (None, str, "k must be a string; got None"),
    (["a"], str, "k must be a string; got ['a']"),
    ("kl", list[str], "k must be a list like [a, b]; got 'kl'"),
    (("a",), list[str], "k must be a list like [a, b]; got ('a',)"),
    (["a", ["b"]], list[str], "k[1] must be a string; got ['b']"),
    (5, ANY_OPTIONS, "k must be a mapping like {local: {window: 64}}; got 5"),
    ({"local": 5}, ANY_OPTIONS, "k.local must be a mapping; got 5"),
    ({None: {}}, ANY_OPTIONS, "k key must be a string; got None"),
    ([1], dict[str, int], "k must be a mapping; got [1]"),
    ({"a": "x"}, dict[str, int], "k.a must be an integer (like 1000, 1_000 or 1e3); got 'x'"),
    (None, str | list[str], "k must be a string or a list of strings; got None"),
    (["a", ["b"]], str | list[str], "k must be a string or a list of strings; got ['a', ['b']]"),
    ("x", int | None, "k must be an integer or null; got 'x'"),
    (float("inf"), int | None, "k must be an integer or null; got inf"),
    ("x", float | None, "k must be a number or null; got 'x'"),
    (1, bool | None, "k must be true or false or null; got 1"),
    ("x", list[str] | None, "k must be a list of strings or null; got 'x'"),
    ([1], dict[str, int] | None, "k must be a mapping or null; got [1]"),
])
def test_each_type_refuses_other_values_in_one_line(value, annotation, message):
    with pytest.raises(ValueError) as caught:
        coerce("k", value, annotation)
    assert str(caught.value) == message


@pytest.mark.parametrize("annotation", [tuple[int], set[str], type(None), Literal["a"], DataConfig])
def test_field_types_outside_the_table_are_a_type_error(annotation):
    with pytest.raises(TypeError, match="k: config fields of type .* are not supported"):
        coerce("k", 1, annotation)


def test_a_union_tries_its_members_in_order_and_stops_at_the_first_that_fits():
    assert coerce("k", 3, int | tuple[int]) == 3  # the unsupported member is never reached
    with pytest.raises(TypeError, match="not supported"):
        coerce("k", 1.5, int | tuple[int])


@pytest.mark.parametrize("raw, annotation, expected", [
    ("010", str, "010"), ("[a", str, "[a"), ("null", str, "null"),  # plain text fields keep the text
    ("null", str | None, None), ("~", str | None, None), ("runs/x", str | None, "runs/x"),
    ("010", str | None, "010"), ("1e3", str | None, "1e3"), ("a: b", str | None, "a: b"),  # a path's text
    ("~", int | None, None), ("'12'", int, 12),
    ("no", bool, False), ("yes", bool, True), ("on", bool, True), ("False", bool, False),
    ("[local, full]", str | list[str], ["local", "full"]),
])
def test_an_override_is_read_as_yaml_unless_its_field_is_plain_text(raw, annotation, expected):
    result = parse_override("k", raw, annotation)
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize("raw, message", [
    ("\x07", "k: cannot read '\\x07' (not valid YAML)"),
    ("{a", "k: cannot read '{a' (expected ',' or '}', but got '<stream end>')"),
    ("a: b: c", "k: cannot read 'a: b: c' (mapping values are not allowed here)"),
])
def test_an_override_that_is_no_yaml_names_the_key_and_the_problem(raw, message):
    with pytest.raises(ValueError) as caught:
        parse_override("k", raw, int)
    assert str(caught.value) == message


def test_a_section_converts_its_known_keys_and_passes_the_others_through():
    assert coerce_section("train", {"lr": float}, {"lr": "1e-3", "bogus": "x"}) == {"lr": 1e-3, "bogus": "x"}
    with pytest.raises(ValueError) as caught:
        coerce_section("train", {"lr": float}, [1])
    assert str(caught.value) == "config section 'train' must be a mapping of keys to values; got [1]"
    with pytest.raises(ValueError, match=r"^train\.lr must be a number"):
        coerce_section("train", {"lr": float}, {"lr": "x"})


def test_field_types_are_the_resolved_annotations_in_field_order():
    types_by_name = field_types(DataConfig)
    assert list(types_by_name) == [f.name for f in fields(DataConfig)]
    assert types_by_name["path"] == (str | None) and types_by_name["seq_len"] is int


@pytest.mark.parametrize("options, expected", [
    (5, 5), (None, None),  # not a mapping: left for ModelConfig to refuse
    ({"nope": {"window": "3e1"}}, {"nope": {"window": "3e1"}}),  # unknown mechanism: unchanged
    ({"local": 5}, {"local": 5}),
    ({"local": {"window": "3e1"}}, {"local": {"window": 30}}),
    ({"local": {"window": "2.5"}}, {"local": {"window": 2.5}}),  # a fraction stays one, for the layer
    ({"topk": {"temperature": "1"}}, {"topk": {"temperature": 1.0}}),
    ({"topk": {"temperature": 1}}, {"topk": {"temperature": 1}}),  # numbers are not retyped
    # Non-finite text, and text for options whose default is no number (bool, None, str, tuple) or
    # that have none, stays text.
    *[(unchanged, unchanged) for unchanged in (
        {"local": {"window": "inf", "rotary_base": "nan"}},
        {"local": {"bias": "1", "block": "64", "nope": "3"}},
        {"topk": {"routing_learning": "1"}, "meta": {"costs": "1"}},
    )],
])
def test_attention_options_retype_only_numeric_text_of_numeric_defaults(options, expected):
    result = coerce_attention_options(options)
    assert result == expected
    if isinstance(expected, dict):
        for mechanism, values in expected.items():
            if isinstance(values, dict):
                assert [type(v) for v in result[mechanism].values()] == [type(v) for v in values.values()]


def test_config_files_and_overrides_use_the_same_conversions(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data: {corpus: 2024, path: null, meta_density: 0.1}\nmodel: {meta_token_id: 3.0}\n")
    config = load_config(path, ["--model.tie_embeddings", "no", "--lr", "1", "--log_stats", "[1, kl]",
                                "--final_eval_tokens", "null"])
    assert config.data.corpus == "2024" and config.data.path is None and config.model.meta_token_id == 3
    assert config.model.tie_embeddings is False and type(config.train.schedule.lr) is float
    assert config.train.log_stats == ["1", "kl"] and config.train.final_eval_tokens is None
