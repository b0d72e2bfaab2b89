import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from routeformer.bench.ops_suite import op_list
from routeformer.cli import CONFIG_DIR, main
from routeformer.train.config import RunConfig


def test_list_prints_every_mechanism_with_options(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("full", "linear", "local", "gated"):
        assert name in out
    assert "window=256" in out


def test_train_eval_sample_round_trip(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--out_dir", str(run), "--steps", "6"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["test"]["bits_per_char"] > 0
    assert summary["checkpoint"] == str(run / "checkpoint.pt")
    assert main(["eval", str(run), "--sequences", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["sequences"] == 8
    assert main(["sample", str(run), "--prompt", "def", "--tokens", "20"]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_meta_token_run_trains_and_evaluates_on_real_characters(tmp_path, capsys):
    run = tmp_path / "meta"
    assert main(["train", "--config", "tiny", "--out_dir", str(run), "--steps", "4",
                 "--model.attention", "meta_tokens", "--data.meta_density", "0.1"]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["test"]
    assert main(["eval", str(run), "--split", "test"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert {key: evaluated[key] for key in trained} == trained


def test_bad_values_give_a_clear_error_and_exit_2(tmp_path, capsys):
    assert main(["train", "--config", "tiny", "--out_dir", str(tmp_path), "--model.positions", "x"]) == 2
    assert "model.positions must be one of" in capsys.readouterr().err
    assert main(["train", "--config", "no-such-config"]) == 2
    assert "bundled: ['char-lm', 'tiny']" in capsys.readouterr().err


def test_bundled_configs_are_valid_and_repo_configs_are_the_same_files():
    for path in CONFIG_DIR.glob("*.yaml"):
        RunConfig.from_dict({**RunConfig().to_dict(), **yaml.safe_load(path.read_text())})
    repo_configs = Path(__file__).parents[1] / "configs"
    assert sorted(p.name for p in repo_configs.glob("*.yaml")) == ["char-lm.yaml", "tiny.yaml"]


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "routeformer.cli", "list"], capture_output=True,
                            text=True, check=True, timeout=120)
    assert "local" in result.stdout


@pytest.mark.parametrize("given", ["ops.md", "ops"])  # a path without a suffix gets .md
def test_bench_ops_writes_a_table(tmp_path, capsys, given):
    output = tmp_path / "ops.md"
    assert main(["bench", "ops", "--lengths", "128", "--repeats", "1", "--window", "32", "--topk", "8",
                 "--no-flex", "--output", str(tmp_path / given)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ops.json", "ops.md"]
    text = output.read_text()
    assert "| 128 | fp32 | sdpa |" in text and "| 128 | bf16 | local(w=32) |" in text
    assert "speed-up = baseline time / op time" in text
    rows = json.loads(output.with_suffix(".json").read_text())["rows"]
    sdpa = next(r for r in rows if r["op"] == "sdpa" and r["dtype"] == "fp32")
    assert sdpa["forward_vs_sdpa"] == 1.0 and sdpa["forward_gflop"] > 0


def test_bench_ops_times_only_the_chosen_families(capsys):
    assert main(["bench", "ops", "--lengths", "64", "--repeats", "1", "--window", "16", "--topk", "4",
                 "--no-flex", "--ops", "linear"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ops = {line.split("|")[3].strip() for line in lines if line.startswith("| 64 |")}
    assert ops == {"sdpa", "linear"}
    with pytest.raises(ValueError, match="unknown op family \\['dense'\\]; allowed: local, linear, topk"):
        op_list(64, batch=1, heads=1, head_dim=8, window=16, topk=4, routing_dim=4, flex=False,
                families=["dense"])


def test_bench_layers_writes_the_layer_table(tmp_path, capsys):
    assert main(["bench", "layers", "--lengths", "32", "--mechanisms", "nope"]) == 2
    assert "--mechanisms: unknown ['nope']" in capsys.readouterr().err
    output = tmp_path / "layers" / "layers.md"
    assert main(["bench", "layers", "--lengths", "32", "--repeats", "1", "--mechanisms", "linear",
                 "--output", str(output)]) == 0
    text = output.read_text()
    assert "Command: `routeformer bench layers --lengths 32 --repeats 1 --mechanisms linear" in text
    rows = json.loads(output.with_suffix(".json").read_text())["rows"]
    assert [r["mechanism"] for r in rows] == ["full", "linear"]  # full: the baseline's row
    assert rows[0]["forward_vs_full"] == 1.0 and rows[1]["forward_ms"] > 0
    assert "| 32 | full | " in text and "| 32 | linear | " in text


def test_bench_compile_takes_a_mechanism_list(tmp_path, capsys):
    assert main(["bench", "compile", "--lengths", "16", "--mechanisms", "nope"]) == 2
    assert "--mechanisms: unknown ['nope']" in capsys.readouterr().err
    output = tmp_path / "compile.md"
    assert main(["bench", "compile", "--lengths", "16", "--repeats", "1", "--dim", "16", "--heads", "2",
                 "--mechanisms", "full", "--output", str(output)]) == 0
    rows = json.loads(output.with_suffix(".json").read_text())["rows"]
    # full: the cheapest layer to compile (expanding's one graph: tests/attention/test_compile.py)
    assert [r["mechanism"] for r in rows] == ["full"] and (rows[0]["graphs"], rows[0]["breaks"]) == (1, 0)
    assert rows[0]["compile_s"] > 0 and rows[0]["fwd_bwd_speedup"] > 0
    assert "--mechanisms full" in output.read_text()


def test_bench_meta_times_soft_and_hard_layers(tmp_path, capsys):
    from routeformer.cli import main

    output = tmp_path / "meta.md"
    assert main(["bench", "meta", "--lengths", "128", "--repeats", "1", "--dim", "32", "--window", "16",
                 "--output", str(output)]) == 0
    import json

    record = json.loads(output.with_suffix(".json").read_text())
    assert [row["impl"] for row in record["rows"]] == [
        "full", "meta(soft)", "meta(hard 20/50/30)", "meta(hard 20/50/30, shared qkv)"]
    hard = record["routing"][1]
    assert hard["hard_fraction"] == 1.0
    assert abs(hard["rows_full"] + hard["rows_linear"] + hard["rows_local"] - 1.0) < 1e-6
    assert hard["flops_vs_full"] < record["routing"][0]["flops_vs_full"]


def test_bench_meta_tokens_times_packed_and_dense_mask_against_sdpa(tmp_path):
    output = tmp_path / "meta_tokens.md"
    assert main(["bench", "meta_tokens", "--lengths", "200", "--repeats", "1", "--density", "0.2",
                 "--output", str(output)]) == 0
    record = json.loads(output.with_suffix(".json").read_text())
    assert [row["impl"] for row in record["rows"]] == [
        "sdpa", "meta_tokens packed (ρ=0.2)", "meta_tokens dense mask (ρ=0.2, paper)"]
    assert record["settings"]["density"] == 0.2
    assert output.read_text().startswith("# meta_tokens benchmark")


def test_bench_meta_tokens_mask_has_the_asked_density():
    from routeformer.bench.meta_tokens_bench import random_meta_mask

    meta = random_meta_mask(3, 4096, 0.1)
    assert meta.sum(1).tolist() == [410, 410, 410]


# Every subcommand, every bad input: one line `routeformer: error: ...`, exit status 2.
@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A trained toy run, an empty directory, a plain file, a junk checkpoint, a missing path."""
    root = tmp_path_factory.mktemp("cli")
    run = root / "run"
    assert main(["train", "--config", "tiny", "--out_dir", str(run), "--steps", "2",
                 "--final_eval_tokens", "512"]) == 0
    (root / "empty").mkdir()
    (root / "file").write_text("x")
    (root / "junk.pt").write_bytes(b"not a checkpoint")
    return {"RUN": str(run), "EMPTY": str(root / "empty"), "FILE": str(root / "file"),
            "JUNK": str(root / "junk.pt"), "MISSING": str(root / "missing")}


BAD_INPUTS = [
    ([], "the following arguments are required: command"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["list", "--bogus"], "unrecognised arguments: --bogus"),
    (["compare", "--bogus"], "unrecognised arguments: --bogus"),
    (["train", "--lr", "abc"], "train.lr must be a number (like 3e-4, 0.1 or 1_000); got 'abc'"),
    (["train", "--steps", "-3"], "train.steps must be a positive integer; got -3"),
    (["train", "--model.attention_options", "5"], "model.attention_options must be a mapping"),
    (["train", "--model.attention", "local", "--model.attention_options", "{local: {bogus: 1}}",
      "--out_dir", "MISSING"], "model.attention_options['local'] has unknown option(s) ['bogus']"),
    (["train", "--model.attention", "nope", "--out_dir", "MISSING"], "unknown attention 'nope'"),
    (["train", "--out_dir", "FILE"], "is a file"),
    (["train", "--out_dir", "FILE/sub"], "is a file"),
    (["train", "--bogus", "1"], "unknown config key 'bogus'"),
    (["train", "--steps"], "override --steps needs a value"),
    (["train", "steps", "3"], "expected an override like --key value; got 'steps'"),
    (["train", "--config", "MISSING"], "is neither a file nor a bundled config"),
    (["train", "--config", "JUNK"], "must hold a mapping"),
    (["train", "--precision", "fp16", "--out_dir", "MISSING"], "train.precision: 'fp16' needs a CUDA device"),
    (["train", "--out_dir", "RUN", "--model.dim", "64"], "holds a run of another config"),
    (["eval", "MISSING"], "does not exist"),
    (["eval", "EMPTY"], "no checkpoint in"),
    (["eval", "JUNK"], "is not a routeformer checkpoint"),
    (["eval", "RUN", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1; got '0'"),
    (["eval", "RUN", "--corpus", "nope"], "argument --corpus/--max-tokens: apply to LM run directories of"),
    (["sample", "RUN", "--tokens", "-1"], "argument --tokens: must be an integer >= 0; got '-1'"),
    (["sample", "RUN", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["sample", "RUN", "--top-k", "0"], "argument --top-k: must be an integer >= 1"),
    (["sample", "RUN", "--prompt", ""], "prompt must not be empty"),
    (["sample", "MISSING"], "does not exist"),
    (["bench", "nope"], "argument suite: invalid choice: 'nope'"),
    (["bench", "ops", "--lengths", "0"], "argument --lengths: must be an integer >= 1; got '0'"),
    (["bench", "ops", "--lengths", "abc"], "argument --lengths: must be an integer >= 1; got 'abc'"),
    (["bench", "ops", "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
    (["bench", "ops", "--lengths", "64", "--repeats", "1", "--output", "FILE/ops.md"], "File exists"),
    (["reproduce", "nope"], "unknown experiment 'nope'"),
    (["reproduce", "--quick", "nope", "--out", "FILE"], "unknown experiment 'nope'"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(a) or "(none)" for a, _ in BAD_INPUTS])
def test_every_bad_input_is_one_line_and_exit_2(places, capsys, argv, message):
    argv = [places.get(arg.split("/")[0], arg.split("/")[0]) + arg[len(arg.split("/")[0]):] for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("routeformer: error: ") and "\n" not in err, err
    assert message in err


def test_a_corrupt_checkpoint_reaches_stderr_as_one_line_without_traceback(places, tmp_path):
    run = Path(shutil.copytree(places["RUN"], tmp_path / "run"))
    for path in run.glob("checkpoint*.pt"):
        path.write_bytes(path.read_bytes()[:-100])  # truncated
    result = subprocess.run([sys.executable, "-m", "routeformer.cli", "eval", str(run)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("routeformer: error: no intact checkpoint in")
    assert all("corrupt or truncated" in line for line in lines[:-1]) and len(lines) == 2


def test_a_bad_override_in_a_subprocess_gives_no_traceback():
    result = subprocess.run([sys.executable, "-m", "routeformer.cli", "train", "--model.attention_options",
                             "5"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("routeformer: error: model.attention_options must be a mapping like "
                             "{local: {window: 64}}; got 5\n")


def test_an_lm_run_takes_out_as_every_training_command_does(tmp_path, capsys):
    for argument in (["--out", str(tmp_path / "a")], [f"--out={tmp_path / 'b'}"]):
        assert main(["train", "--config", "tiny", *argument, "--steps", "2"]) == 0
    assert (tmp_path / "a" / "checkpoint.pt").is_file() and (tmp_path / "b" / "checkpoint.pt").is_file()
    capsys.readouterr()
    assert main(["train", "--config", "tiny", "--out", str(tmp_path / "c"), "--out_dir", str(tmp_path / "d"),
                 "--steps", "2"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("argument --out: the run directory, the same as --out_dir; give one of them")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
