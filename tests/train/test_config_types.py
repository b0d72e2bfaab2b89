"""Config values are typed by the schema: YAML 1.1 strings like `3e-4` are numbers where a number goes."""

import pytest

from routeformer.train import load_config
from routeformer.train.config import RunConfig


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
