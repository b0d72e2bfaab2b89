"""The command line of `routeformer`: the parser of every subcommand, its help texts and the argument
types that reject bad numbers, and the parser that turns a bad command line into a UsageError."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

DEFAULT_CONFIG = "char-lm"  # the bundled config `routeformer train` uses without --config


class UsageError(ValueError):
    """A command line argparse rejected."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line (`routeformer: error: ...`, exit 2,
    via `main`) instead of printing the usage block and exiting from inside the parser."""

    help_tail = None  # a callable returning text appended to --help (computed only when asked)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")

    def format_help(self) -> str:
        return super().format_help() + (self.help_tail() if self.help_tail else "")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _bounded_int(text, 0)


def _bounded_int(text: str, minimum: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0; got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text!r}")
    return value


def unit_float(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1); got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1); got {text!r}")
    return value


BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def boolean(text: str) -> bool:
    """argparse type: true/yes/1 or false/no/0 (any case)."""
    value = BOOLEANS.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be true or false; got {text!r}")
    return value


def key_values(items: list[str], argument: str, accepted: Iterable[str] | None = None,
               allowed: str = "") -> dict[str, Any]:
    """{KEY: VALUE} from a repeatable `argument`'s ["KEY=VALUE", ...], each VALUE read as YAML
    (numbers, booleans, strings). ValueError "argument ARGUMENT: expected KEY=VALUE{allowed}; got
    ITEM" for an item that is not KEY=VALUE or whose KEY is not in `accepted` (None: any KEY)."""
    import yaml

    chosen: dict[str, Any] = {}
    for item in items:
        key, equals, value = item.partition("=")
        if not equals or not key or (accepted is not None and key not in accepted):
            raise ValueError(f"argument {argument}: expected KEY=VALUE{allowed}; got {item!r}")
        chosen[key] = yaml.safe_load(value) if value else value
    return chosen


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The backbone overrides `--model.KEY VALUE` (KEY: a field of `train.on_task.ModelSpec`; each
    lands in `model_KEY`, None when not given) of every command that trains on a budget's backbone:
    `train --task` and `compare`."""
    parser.add_argument("--model.dim", dest="model_dim", type=positive_int, default=None,
                        help="backbone width (default: the budget's backbone)")
    parser.add_argument("--model.depth", dest="model_depth", type=positive_int, default=None)
    parser.add_argument("--model.heads", dest="model_heads", type=positive_int, default=None)
    parser.add_argument("--model.mlp_ratio", dest="model_mlp_ratio", type=positive_float, default=None)
    parser.add_argument("--model.positions", dest="model_positions", default=None,
                        help="learned, rotary or none")
    parser.add_argument("--model.tie_embeddings", dest="model_tie_embeddings", type=boolean, default=None,
                        metavar="true|false",
                        help="true: the output head shares the token embedding's weight (default: the "
                             "budget's backbone, a separate head)")
    parser.add_argument("--model.dropout", dest="model_dropout", type=unit_float, default=None,
                        help="dropout after each block and on the embeddings while training, in [0, 1) "
                             "(default: the budget's backbone, none)")


DEVICES = ("cpu", "cuda", "auto")  # where a task run trains: --device, --spec's --device, train.device


def build_task_train_parser() -> argparse.ArgumentParser:
    """The arguments of `routeformer train --task NAME` (parsed after `train`'s own: without --task
    the rest of the line is the config's overrides)."""
    parser = _Parser(prog="routeformer train --task NAME", add_help=False)
    parser.add_argument("--mechanism", default=None,
                        help="registered attention (routeformer list; default: the baseline, full)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="the task's seq_len option")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other task option (repeatable; routeformer.tasks.list_tasks() names them)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="training steps (default: compare --quick's for the task; the warm-up keeps its "
                             "share of the steps)")
    parser.add_argument("--batch-size", type=positive_int, default=None)
    parser.add_argument("--lr", type=positive_float, default=None, help="peak learning rate")
    parser.add_argument("--evals", type=positive_int, default=None,
                        help="validation evaluations (and checkpoints) during training")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the weights and batches")
    parser.add_argument("--log-every", type=non_negative_int, default=0, metavar="N",
                        help="a training line in metrics.jsonl every N updates (loss, lr, grad_norm, "
                             "tokens_per_s; default 0: none)")
    parser.add_argument("--checkpoint-every", type=non_negative_int, default=0, metavar="N",
                        help="a checkpoint every N steps between the evaluations' (default 0: at "
                             "evaluations only)")
    parser.add_argument("--keep-checkpoints", type=positive_int, default=2, metavar="K",
                        help="the newest K training checkpoints kept while the run trains (default 2)")
    parser.add_argument("--budget", choices=("quick", "long"), default="quick",
                        help="whose setup and backbone: compare --quick's (default) or compare --long's "
                             "(its curriculum; tasks mqar, mqar_512, lm, code_lm): --budget long trains "
                             "the model compare --long trains for the same mechanism and seed")
    parser.add_argument("--mechanism-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the attention layer (repeatable; routeformer list names them), "
                             "over the budget's options for the mechanism")
    add_model_arguments(parser)
    parser.add_argument("--betas", type=unit_float, nargs=2, default=None, metavar=("B1", "B2"),
                        help="AdamW's betas, each in [0, 1) (default: 0.9 0.999)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="the training forward's precision: fp32 (default), bf16 (bfloat16 autocast) or "
                             "fp16 (float16 autocast and a gradient scaler; --device cuda only); weights, "
                             "optimizer and evaluation stay fp32")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the model trains and is evaluated: cpu (default), cuda (cuda:LOCAL_RANK "
                             "under torchrun) or auto (cuda when available)")
    parser.add_argument("--logger", choices=("jsonl", "tensorboard"), default="jsonl",
                        help="where the run's metrics go besides record.json: metrics.jsonl (default), or "
                             "metrics.jsonl and TensorBoard event files in DIR/tensorboard (.[tensorboard])")
    parser.add_argument("--out", default=None,
                        help="run directory (default: runs/train-TASK-MECHANISM-seedS)")
    return parser


def _train_help() -> str:
    task_arguments = build_task_train_parser().format_help().partition("\n\n")[2]
    return ("\nwith --task NAME (any registered task, trained as compare trains it; a re-run resumes):\n"
            + task_arguments + _config_keys_help())


def _config_keys_help() -> str:
    from routeformer.train.config import describe_keys

    return ("\nconfig keys (--key value; the code's defaults, which the --config file may change):\n"
            + describe_keys() + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="routeformer", description="Routed attention for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)

    compare = commands.add_parser(
        "compare", help="mechanisms on the same tasks, seeds and budget, one report",
        description="Train mechanisms on the same tasks (char LM, Zoology MQAR, ListOps; routeformer.tasks) "
                    "with one backbone, budget and batch stream per seed; report quality as mean ± sd over "
                    "seeds beside each task's chance level and measured shortcut baselines, executed "
                    "attention FLOPs, time and memory (report.md + result.json + PNGs). Finished runs are "
                    "kept: run it again to resume.")
    compare.add_argument("--quick", action="store_true",
                         help="the quick budget (about 10 minutes on 2 cores; a subset of mechanisms)")
    compare.add_argument("--long", action="store_true",
                         help="the long budget: recall at T=4096 and a Python-source LM at T=4096, evaluated "
                              "at 1x/2x/4x, with costs at the same lengths (recall 56 min + LM 77 min "
                              "on 2 cores, measured apart)")
    compare.add_argument("--mechanisms", nargs="+", default=None,
                         help="subset of `routeformer list` (default: the budget's selection)")
    compare.add_argument("--tasks", nargs="+", default=None,
                         help="subset of lm mqar listops (default: all); with --long: mqar code_lm "
                              "(default; lm for code_lm when ../shared/data/python-stdlib is absent), "
                              "lm, mqar_512")
    compare.add_argument("--seeds", type=int, default=None, help="seeds per mechanism (default: 3)")
    compare.add_argument("--workers", type=int, default=2,
                         help="training processes, one thread each (default: 2)")
    compare.add_argument("--corpus", default=None,
                         help="LM corpus (default: the embedded pydoc; with --long, tinyshakespeare when "
                              "a local copy exists; wikitext2 for WikiText-2 text)")
    compare.add_argument("--out", default=None,
                         help="output directory (default: runs/compare, with --long runs/compare-long)")
    compare.add_argument("--no-bench", action="store_true", help="skip the layer time/memory benchmark")
    compare.add_argument("--device", choices=DEVICES, default="cpu",
                         help="where every run trains and is evaluated: cpu (default), cuda or auto (cuda "
                              "when available); the costs are measured on the CPU either way")
    add_model_arguments(compare)

    train = commands.add_parser(
        "train", help="train a character-level language model, or a model on any task (--task)",
        description="Train a char-level LM: the task-lm run of the config. Extra --key value pairs "
                    "override the config (dotted, e.g. --model.attention local, or bare when unambiguous, "
                    "e.g. --steps 100). The run directory is --out DIR (the config's out_dir); one that "
                    "holds a checkpoint resumes from it, a finished one trains on with more steps. With "
                    "--task NAME: train on a registered task through compare's run path (below). With "
                    "--task lm --config FILE: the same run, in --out (default runs/train-lm-...); the "
                    "line's --key value pairs are the config's overrides, not the options below.")
    train.add_argument("--config", default=None,
                       help=f"YAML file or bundled config name (default: {DEFAULT_CONFIG}); with --task lm: "
                            "the same (--key value overrides, --out DIR)")
    train.add_argument("--task", default=None, help="a registered task (mqar, lm, listops, ...)")
    train.add_argument("--spec", default=None, metavar="FILE",
                       help="a run spec: JSON or YAML of a task run's config.json form, or a task run "
                            "directory (retrains its run); the rest of the line is --KEY.PATH VALUE "
                            "overrides (--seed 2, --spec.dim 128, --setup.schedule.steps 100) and --out DIR")
    train.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    train.help_tail = _train_help

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on its validation split")
    evaluate.add_argument("checkpoint", help="run directory or checkpoint file")
    evaluate.add_argument("--corpus", help="LM run of the earlier layout (config.yaml): evaluate on "
                          "another corpus spec's validation split")
    evaluate.add_argument("--max-tokens", type=positive_int, default=None,
                          help="LM run of the earlier layout (config.yaml): tokens evaluated")
    evaluate.add_argument("--split", choices=("validation", "test"), default=None,
                          help="task run: the split of its task's fixed sample (default: validation)")
    evaluate.add_argument("--sequences", type=positive_int, default=None,
                          help="task run: sequences of that sample (default: as many as training used)")

    sample = commands.add_parser("sample", help="generate text from a checkpoint")
    sample.add_argument("checkpoint", help="run directory or checkpoint file")
    sample.add_argument("--prompt", default="\n")
    sample.add_argument("--tokens", type=non_negative_int, default=200)
    sample.add_argument("--temperature", type=non_negative_float, default=0.8)
    sample.add_argument("--top-k", type=positive_int, default=None)
    sample.add_argument("--seed", type=int, default=0)

    commands.add_parser("list", help="list the registered attention mechanisms and their options")

    doctor = commands.add_parser("doctor", help="what this machine has (compiler, CPU, native kernels, "
                                                "triton, CUDA) and the backend each mechanism takes")
    doctor.add_argument("--length", type=positive_int, default=1100,
                        help="tokens of the probe input (above 1024: topk routes on every backend)")

    sparsify = commands.add_parser(
        "sparsify", help="convert a trained dense task run into a routed one (dense warm-up, then sparse)",
        description="Copy a dense task run's weights into a routed model and train its routing parameters: "
                    "stage 1 (--steps) with the dense model frozen (topk: by the KL to dense attention over "
                    "every key; meta: its controller by the task loss; mita has nothing to warm up); stage 2 "
                    "(--sparse-steps) everything, on the task loss. An LM run directory of the earlier "
                    "layout converts as the task-lm run its config translates to. Writes a task run "
                    "directory that eval, sample and export-hf read (docs/sparsify.md).")
    sparsify.add_argument("source", metavar="SRC", help="a run directory of routeformer train --task "
                                                        "or routeformer train, or its checkpoint file")
    sparsify.add_argument("--mechanism", required=True,
                          help="the routed attention: topk, meta or mita (docs/sparsify.md)")
    sparsify.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                          help="an option of the routed layer (repeatable), e.g. topk=16")
    sparsify.add_argument("--steps", type=non_negative_int, default=None,
                          help="stage-1 steps (default: 5%% of the source's training steps, at least 20; "
                               "0 for mita)")
    sparsify.add_argument("--sparse-steps", type=non_negative_int, default=0,
                          help="stage-2 steps (default 0)")
    sparsify.add_argument("--lr", type=positive_float, default=None, help="stage-1 peak rate (default 1e-3)")
    sparsify.add_argument("--sparse-lr", type=positive_float, default=None,
                          help="stage-2 peak rate (default: 0.1 x the source's)")
    sparsify.add_argument("--batch-size", type=positive_int, default=None,
                          help="batch size (default: the source's)")
    sparsify.add_argument("--seed", type=non_negative_int, default=0, help="seed of the routing weights and "
                                                                            "the batches")
    sparsify.add_argument("--out", required=True, help="new run directory (must not exist)")
    export_hf = commands.add_parser("export-hf", help="a trained checkpoint as a transformers model")
    export_hf.add_argument("run_dir", help="run directory or checkpoint file")
    export_hf.add_argument("out_dir", help="new directory for config.json + model.safetensors")

    bench = commands.add_parser("bench", help="speed and memory benchmarks")
    from routeformer.cli.bench_command import SUITES

    bench.add_argument("suite", choices=list(SUITES))
    bench.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 4096, 16384])
    bench.add_argument("--repeats", type=positive_int, default=5)
    bench.add_argument("--window", type=positive_int, default=256)
    bench.add_argument("--batch", type=positive_int, default=1)
    bench.add_argument("--heads", type=positive_int, default=4)
    bench.add_argument("--head-dim", type=positive_int, default=64)
    bench.add_argument("--dim", type=positive_int, default=256, help="meta and compile suites: model dim D")
    bench.add_argument("--topk", type=positive_int, default=64,
                       help="topk: keys per query; mita: keys per expert")
    bench.add_argument("--landmarks", type=positive_int, default=64, help="mita suite: landmarks (experts)")
    bench.add_argument("--sdpa-up-to", type=positive_int, default=65536,
                       help="mita suite: longest T timed for SDPA")
    bench.add_argument("--causal-up-to", type=positive_int, default=65536,
                       help="mita suite: longest causal T")
    bench.add_argument("--routing-dim", type=positive_int, default=16, help="topk suite: routing dim")
    bench.add_argument("--density", type=non_negative_float, default=0.1,
                       help="meta_tokens suite: meta-token density")
    bench.add_argument("--new-tokens", type=positive_int, default=32, help="generate suite: tokens to sample")
    bench.add_argument("--depth", type=positive_int, default=1, help="generate suite: layers of the model")
    bench.add_argument("--decode-threads", type=positive_int, default=1,
                       help="generate suite: torch threads for the decode steps (the prefill uses all)")
    bench.add_argument("--up-to", nargs="+", default=None, metavar="MECHANISM=LENGTH",
                       help="generate suite: the longest context a mechanism runs at (its prefill is slow)")
    bench.add_argument("--reread", action="store_true",
                       help="generate suite: time generation with and without the cache (short contexts) "
                            "instead of the decode steps")
    bench.add_argument("--no-flex", action="store_true",
                       help="ops suite: leave FlexAttention out (compiling it takes seconds)")
    bench.add_argument("--ops", nargs="+", choices=("local", "linear", "topk"), default=None,
                       help="ops suite: time only these op families beside SDPA (default: all)")
    bench.add_argument("--mechanisms", nargs="+", default=None,
                       help="compile suite: the mechanisms to compile (default: every registered one); "
                            "layers suite: the ones timed against full (default: local linear topk mita); "
                            "steps suite: the ones whose model step is timed against full's "
                            "(default: topk mita meta); "
                            "generate suite: the ones decoded (default: every one with a cache)")
    bench.add_argument("--tokens", type=positive_int, default=8192,
                       help="steps suite: tokens per training step at every length (batch = tokens // T)")
    bench.add_argument("--meta-shares", type=float, nargs=3, default=None,
                       metavar=("FULL", "LINEAR", "LOCAL"),
                       help="steps suite: time meta hard-routed, with compare --long's recipe past its "
                            "warm-up, at these shares of tokens per expert (e.g. a trained router's; "
                            "default: the fresh router's own routing, dense)")
    bench.add_argument("--split", action="store_true",
                       help="layers suite: split each mechanism's training step into projections, routing, "
                            "attention, auxiliary losses, backward and other (torch.profiler ranges)")
    bench.add_argument("--output", default=None,
                       help="write a Markdown table (and JSON beside it); a path without a suffix gets .md")

    reproduce = commands.add_parser("reproduce", help="run a reproduced paper experiment")
    reproduce.add_argument("name", nargs="?", help="experiment name (see --list)")
    reproduce.add_argument("--list", action="store_true", help="list the experiments")
    reproduce.add_argument("--quick", action="store_true", help="a reduced setting that runs in minutes")
    reproduce.add_argument("--out", default=None, help="output directory (default runs/NAME[-quick])")
    return parser

