"""Wrong calls, library and command line: each is refused with its exception type and a message
naming the argument; at the command line, exit status 2, one line `routeformer: error: ...` on
stderr, no traceback, and nothing written to the run directory."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from torch import nn

import routeformer as rf
from routeformer.cli import main
from routeformer.data.vocab import CharVocab
from tests.extras import require

DIM, HEADS = 16, 2


def tiny_config(**changes) -> rf.ModelConfig:
    return rf.ModelConfig(**{"vocab_size": 16, "dim": DIM, "depth": 1, "heads": HEADS, **changes})


@pytest.fixture(scope="module")
def layer() -> nn.Module:
    return rf.build_attention("full", dim=DIM, heads=HEADS, causal=True)


@pytest.fixture(scope="module")
def model() -> rf.CausalLM:
    return rf.CausalLM(tiny_config())


# -- attention layers -------------------------------------------------------------------------------
def plain_x() -> tuple[torch.Tensor]:
    """A well-formed input, for the calls whose keyword arguments are wrong."""
    return (torch.randn(1, 4, DIM),)


LAYER_CALLS = {
    "numpy input": (
        lambda: (np.zeros((1, 4, DIM), dtype=np.float32),),
        {},
        TypeError,
        "x must be a torch.Tensor",
    ),
    "list input": (lambda: ([[0.0] * DIM],), {}, TypeError, "x must be a torch.Tensor"),
    "float64 input": (lambda: (torch.randn(1, 4, DIM).double(),), {}, TypeError, "x has dtype torch.float64"),
    "integer input": (
        lambda: (torch.zeros(1, 4, DIM, dtype=torch.long),),
        {},
        TypeError,
        "x must be a floating",
    ),
    "wrong width": (lambda: (torch.randn(1, 4, DIM + 1),), {}, ValueError, "x must have shape"),
    "2-d input": (lambda: (torch.randn(4, DIM),), {}, ValueError, "x must have shape"),
    "float mask": (plain_x, {"mask": torch.ones(1, 4)}, ValueError, "mask must be a bool"),
    "mask shape": (plain_x, {"mask": torch.ones(1, 5, dtype=torch.bool)}, ValueError, "mask must be a bool"),
    "numpy mask": (plain_x, {"mask": np.ones((1, 4), dtype=bool)}, TypeError, "mask must be a torch.Tensor"),
    "negative positions": (
        plain_x,
        {"positions": torch.tensor([[-1, 0, 1, 2]])},
        ValueError,
        "positions must be >= 0",
    ),
    "float positions": (
        plain_x,
        {"positions": torch.zeros(1, 4)},
        ValueError,
        "positions must be an integer",
    ),
    "positions shape": (
        plain_x,
        {"positions": torch.zeros(1, 3, dtype=torch.long)},
        ValueError,
        "positions must be an integer",
    ),
}


def test_every_mechanism_refuses_a_float64_input_to_a_float32_layer():
    for name in rf.list_attentions():
        built = rf.build_attention(name, dim=DIM, heads=HEADS, causal=True)
        with pytest.raises(TypeError, match=r"x has dtype torch.float64 but the layer's parameters are"):
            built(torch.randn(1, 4, DIM).double())


def test_autocast_accepts_an_input_of_another_dtype(layer):
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.isfinite(layer(torch.randn(1, 4, DIM).bfloat16()).out).all()


BUILD_CALLS = {
    "causal as a string": ({"causal": "false"}, TypeError, "causal must be a bool.*'false'"),
    "causal as an int": ({"causal": 1}, TypeError, "causal must be a bool"),
    "rotary as a string": (
        {"rotary": "yes"},
        TypeError,
        "option 'rotary' of attention 'full' must be a bool",
    ),
    "bias as None": ({"bias": None}, TypeError, "option 'bias'"),
    "unknown option": ({"windo": 3}, ValueError, r"unknown option\(s\) \['windo'\] for attention 'full'"),
    "zero heads": ({"heads": 0}, ValueError, "heads"),
}


@pytest.mark.parametrize("case", list(BUILD_CALLS))
def test_build_attention(case):
    changes, error, message = BUILD_CALLS[case]
    arguments = {"dim": DIM, "heads": HEADS, "causal": True, **changes}
    with pytest.raises(error, match=message):
        rf.build_attention("full", **arguments)


def test_unknown_mechanism_name():
    with pytest.raises(ValueError, match=r"unknown attention 'ful'; registered: \["):
        rf.build_attention("ful", dim=DIM, heads=HEADS)


# -- model configuration --------------------------------------------------------------------------
CONFIG_CALLS = {
    "unknown mechanism key": (
        {"attention": "local", "attention_options": {"locl": {"window": 8}}},
        ValueError,
        "attention_options has unknown mechanism 'locl'",
    ),
    "unknown option key": (
        {"attention": "local", "attention_options": {"local": {"windo": 8}}},
        ValueError,
        r"attention_options\['local'\] has unknown option\(s\) \['windo'\]",
    ),
    "options not a dict": ({"attention_options": {"local": 8}}, TypeError, r"attention_options\['local'\]"),
    "attention_options a list": ({"attention_options": ["local"]}, TypeError, "model.attention_options must"),
    "causal as a string": ({"causal": "false"}, TypeError, "model.causal must be a bool"),
    "tie_embeddings as an int": ({"tie_embeddings": 0}, TypeError, "model.tie_embeddings must be a bool"),
    "negative dim": ({"dim": -4}, ValueError, "model.dim"),
    "unknown positions": ({"positions": "sinus"}, ValueError, "model.positions must be one of"),
    "dropout of 1": ({"dropout": 1.0}, ValueError, "model.dropout must be in"),
    "depth and attention list": ({"attention": ["full", "local"]}, ValueError, "model.attention lists 2"),
}


@pytest.mark.parametrize("case", list(CONFIG_CALLS))
def test_model_config(case):
    changes, error, message = CONFIG_CALLS[case]
    with pytest.raises(error, match=message):
        tiny_config(**changes)


def test_model_config_from_dict_unknown_key():
    with pytest.raises(ValueError, match=r"unknown model config key\(s\) \['dimm'\]"):
        rf.ModelConfig.from_dict({"dimm": 8})


# -- models ---------------------------------------------------------------------------------------
MODEL_CALLS = {
    "token id at the vocabulary size": (
        lambda: (torch.tensor([[1, 2, 16]]),),
        {},
        ValueError,
        r"tokens must be ids in \[0, vocab_size=16\); got \[16\]",
    ),
    "negative token id": (
        lambda: (torch.tensor([[-1, 2, 3]]),),
        {},
        ValueError,
        r"tokens must be ids in \[0, vocab_size=16\); got \[-1\]",
    ),
    "token id outside the vocabulary with labels and mask": (
        lambda: (torch.tensor([[1, 2, 300]]), torch.tensor([[2, 3, 4]])),
        {"mask": torch.ones(1, 3, dtype=torch.bool)},
        ValueError,
        r"vocab_size=16\); got \[300\]",
    ),
    "numpy tokens": (
        lambda: (np.zeros((1, 3), dtype=np.int64),),
        {},
        TypeError,
        "tokens must be a torch.Tensor of integer ids.*ndarray",
    ),
    "float tokens": (lambda: (torch.zeros(1, 3),), {}, TypeError, "tokens must hold integer ids"),
    "labels of another shape": (
        lambda: (torch.tensor([[1, 2, 3]]), torch.tensor([1, 2, 3])),
        {},
        ValueError,
        r"labels must have shape \[B, T\].*= \(1, 3\); got \(3,\)",
    ),
    "float labels": (
        lambda: (torch.tensor([[1, 2, 3]]), torch.zeros(1, 3)),
        {},
        TypeError,
        "labels must be an integer tensor",
    ),
    "negative positions": (
        lambda: (torch.tensor([[1, 2, 3]]),),
        {"positions": torch.tensor([[-2, -1, 0]])},
        ValueError,
        "positions must be >= 0",
    ),
}


CALLS = {"layer": LAYER_CALLS, "model": MODEL_CALLS}


@pytest.mark.parametrize(
    ("callee", "case"),
    [(callee, case) for callee, calls in CALLS.items() for case in calls],
    ids=lambda value: value,
)
def test_wrong_call(request, callee, case):
    """The attention layer (fixture `layer`) or the model (fixture `model`) refuses a wrong call."""
    make_args, kwargs, error, message = CALLS[callee][case]
    with pytest.raises(error, match=message):
        request.getfixturevalue(callee)(*make_args(), **kwargs)


def test_classifier_labels_per_token():
    classifier = rf.SequenceClassifier(tiny_config(causal=False))
    with pytest.raises(ValueError, match=r"labels must have shape \[B\], one class per sequence"):
        classifier(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 0]]))


# -- character vocabulary -------------------------------------------------------------------------
def test_prompt_characters_outside_the_vocabulary():
    vocab = CharVocab.from_text("abc")
    with pytest.raises(ValueError, match="--prompt holds 2 character.*'日' '本'|'本' '日'"):
        vocab.check_known("a日本", "--prompt")
    vocab.check_known("cab", "--prompt")  # known characters pass


# -- transformers integration ---------------------------------------------------------------------
def test_patch_attention_on_a_plain_module():
    patch_attention = require("routeformer.integrations.hf", "hf").patch_attention

    with pytest.raises(TypeError, match="model must be a transformers model.*got Linear"):
        patch_attention(nn.Linear(3, 3), "local")


def test_patch_attention_twice():
    transformers = require("transformers", "hf")
    from routeformer.integrations.hf import patch_attention

    config = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=1, vocab_size=32, n_positions=32)
    gpt2 = transformers.GPT2LMHeadModel(config)
    patch_attention(gpt2, "local", window=4)
    with pytest.raises(ValueError, match="model is already patched with routeformer's 'local' attention"):
        patch_attention(gpt2, "full")


# -- the command line -----------------------------------------------------------------------------
def cli_refuses(argv: list[str], capsys, message: str, out_dir=None) -> None:
    """`routeformer argv` exits 2 with one line 'routeformer: error: ...' matching `message`."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("routeformer: error:"), err
    assert "Traceback" not in err[0]
    assert re.search(message, err[0]), err[0]
    if out_dir is not None:
        assert not out_dir.exists(), f"{out_dir} was written"


CLI_CALLS = {
    "negative steps": (["train", "--steps", "-1"], "train.steps must be a positive integer; got -1"),
    "non-integer dim": (["train", "--config", "tiny", "--model.dim", "abc"], "model.dim must be an integer"),
    "unknown key": (["train", "--config", "tiny", "--nokey", "3"], "unknown config key 'nokey'"),
    "unknown mechanism": (
        ["train", "--config", "tiny", "--model.attention", "locl"],
        "unknown attention 'locl'",
    ),
    "causal not a boolean": (
        ["train", "--config", "tiny", "--model.causal", "maybe"],
        "model.causal must be true or false; got 'maybe'",
    ),
    "a meta-token id without meta-tokens": (
        ["train", "--config", "tiny", "--model.meta_token_id", "3"],
        "model.meta_token_id: routeformer train sets it to the tokeniser.s pause id where data.meta_density",
    ),
    "a language model that reads ahead": (
        ["train", "--config", "tiny", "--model.causal", "false"],
        "model.causal: routeformer train trains a causal language model; got False",
    ),
}


@pytest.mark.parametrize("case", list(CLI_CALLS))
def test_cli_train(case, tmp_path, capsys):
    argv, message = CLI_CALLS[case]
    out = tmp_path / "run"
    cli_refuses([*argv, "--out_dir", str(out)], capsys, message, out)


def test_cli_unknown_task(tmp_path, capsys):
    out = tmp_path / "run"
    cli_refuses(
        ["train", "--task", "nosuch", "--out", str(out)],
        capsys,
        "argument --task: unknown task 'nosuch'",
        out,
    )


def test_cli_unknown_attention_options_in_a_config_file(tmp_path, capsys):
    config = tmp_path / "model.json"
    config.write_text(
        json.dumps(
            {"model": {"attention": "local", "depth": 1, "attention_options": {"locl": {"window": 8}}}}
        )
    )
    out = tmp_path / "run"
    cli_refuses(
        ["train", "--config", str(config), "--out_dir", str(out)],
        capsys,
        "attention_options has unknown mechanism 'locl'",
        out,
    )


def test_cli_bench_length_zero(capsys):
    cli_refuses(["bench", "ops", "--lengths", "0"], capsys, "argument --lengths: must be an integer >= 1")


def test_cli_eval_missing_checkpoint(tmp_path, capsys):
    cli_refuses(["eval", str(tmp_path / "none")], capsys, "checkpoint .* does not exist")


def test_cli_unrecognised_argument(capsys):
    cli_refuses(["list", "--bogus"], capsys, "unrecognised arguments: --bogus")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("wrong-calls") / "run"
    assert main(["train", "--config", "tiny", "--out_dir", str(run), "--steps", "2"]) == 0
    return run


def test_cli_sample_prompt_outside_the_vocabulary(trained_run, capsys):
    capsys.readouterr()
    cli_refuses(
        ["sample", str(trained_run), "--prompt", "日本"],
        capsys,
        r"--prompt holds 2 character\(s\) outside the model's vocabulary",
    )


def test_cli_sample_negative_temperature(trained_run, capsys):
    capsys.readouterr()
    cli_refuses(
        ["sample", str(trained_run), "--prompt", "de", "--temperature", "-1"],
        capsys,
        "argument --temperature: must be a finite number >= 0",
    )
