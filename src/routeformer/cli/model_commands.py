"""The commands that train a model or use a trained one: compare, train, eval, sample and export-hf,
with the config and checkpoint lookups they share."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def command_compare(args: argparse.Namespace) -> int:
    from routeformer.cli.task_train import available_device, model_changes
    from routeformer.compare.run import run_compare

    args.device = available_device(args.device, "argument --device")
    args.model = model_changes(args)
    try:
        if args.long:
            report = _compare_long(args)
        else:
            report = run_compare(args.out or "runs/compare", mechanisms=args.mechanisms, tasks=args.tasks,
                                 quick=args.quick, corpus=args.corpus or "pydoc", bench=not args.no_bench,
                                 seeds=args.seeds, workers=args.workers, device=args.device,
                                 model=args.model)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(report.read_text())
    print(f"wrote {report.parent}/ (report.md, result.json, PNGs)")
    return 0



def _compare_long(args: argparse.Namespace):
    """`compare --long`: compare's LONG budget (compare/budgets.py)."""
    from routeformer.compare.budgets import LONG, check_long_selection
    from routeformer.compare.run import model_arguments, run_compare

    if args.quick:
        raise ValueError("--quick and --long: choose one budget")
    if args.no_bench:
        raise ValueError("--no-bench: --long has no layer benchmark (it measures costs at the task lengths)")
    if args.seeds is not None and (args.seeds < 1):
        raise ValueError(f"--seeds must be a positive integer; got {args.seeds}")
    mechanisms, tasks = check_long_selection(args.mechanisms, args.tasks)
    command = "routeformer compare --long" + "".join([
        f" --tasks {' '.join(args.tasks)}" if args.tasks else "",
        f" --mechanisms {' '.join(args.mechanisms)}" if args.mechanisms else "",
        f" --seeds {args.seeds}" if args.seeds is not None else "",
        f" --corpus {args.corpus}" if args.corpus else "",
        f" --device {args.device}" if args.device != "cpu" else "", model_arguments(args.model)])
    out = args.out or "runs/compare-long"
    return run_compare(out, mechanisms=mechanisms, tasks=tasks, budget=LONG, seeds=args.seeds,
                       workers=args.workers, corpus=args.corpus, command=command, device=args.device,
                       model=args.model)


def command_train(args: argparse.Namespace, overrides: list[str]) -> int:
    """`routeformer train`: a task run (--task, --spec; cli/task_train.py), or without them the LM run
    of a config (default DEFAULT_CONFIG), the task-lm run of `train --task lm --config` in the
    config's out_dir (--out, --out_dir)."""
    from routeformer.cli.parser import DEFAULT_CONFIG
    from routeformer.cli.task_train import command_train_task

    if args.task is None and args.spec is None:
        args.task, args.config = "lm", args.config or DEFAULT_CONFIG
        return command_train_task(args, out_as_out_dir(overrides), lm_run=True)
    return command_train_task(args, overrides)


def out_as_out_dir(overrides: list[str]) -> list[str]:
    """An LM run's overrides with `--out DIR` (`--out=DIR`), the run directory of every other command
    that trains, read as the config key `--out_dir DIR`. ValueError when both are given."""
    names = [argument.partition("=")[0] for argument in overrides]
    if "--out" in names and "--out_dir" in names:
        raise ValueError("argument --out: the run directory, the same as --out_dir; give one of them")
    return [f"--out_dir{argument[len('--out'):]}" if argument.partition("=")[0] == "--out" else argument
            for argument in overrides]


def usable_checkpoint(target: str):
    """(file, state) of the checkpoint eval, sample and export-hf read (`checkpoint_for_use`: a run
    directory's newest checkpoint, when intact). CheckpointError otherwise; for a task run directory
    without a checkpoint, its message says why and what to run."""
    from routeformer.train.checkpoint import CheckpointError, checkpoint_for_use

    try:
        return checkpoint_for_use(target)
    except CheckpointError as error:
        raise CheckpointError(with_run_hint(target, error)) from None


def with_run_hint(target: str, error: Exception) -> str:
    """`error`'s message, or, for a task run directory that holds no checkpoint, what it holds
    instead and the command that gives it one."""
    from routeformer.runner.run_dir import CONFIG_FILE, RECORD_FILE
    from routeformer.train.checkpoint import checkpoint_files

    directory = Path(target)
    if not (directory / CONFIG_FILE).is_file() or checkpoint_files(directory):
        return str(error)
    if (directory / RECORD_FILE).is_file():
        return (f"{target!r} holds a task run's {RECORD_FILE} but no checkpoint of its model; train it again "
                "with its `routeformer train` command and --fresh to keep one")
    return (f"{target!r} holds a task run that has not finished (no checkpoint of its model yet); run its "
            "`routeformer train` command again to finish it")


def load_for_use(target: str):
    """(model, tokeniser, config, checkpoint file, step) of a `routeformer train` LM run for eval and
    sample. CheckpointError when a run directory's newest checkpoint is unreadable: an older state
    is used only when its file is named explicitly."""
    from routeformer.train.checkpoint import trained_model

    path, state = usable_checkpoint(target)
    return (*trained_model(state), path, state.get("step"))


def command_eval(args: argparse.Namespace) -> int:
    from routeformer.data.corpora import load_corpus, load_data
    from routeformer.train.checkpoint import is_task_model, trained_model
    from routeformer.train.evaluate import evaluate_lm

    path, state = usable_checkpoint(args.checkpoint)
    if is_task_model(state):
        return _eval_task_run(args, path, state)
    if args.split is not None or args.sequences is not None:
        raise ValueError("argument --split/--sequences: apply to task runs (routeformer train); an LM run "
                         "of the earlier layout is evaluated on its corpus's validation text (--corpus, "
                         "--max-tokens)")
    model, vocab, config = trained_model(state)
    corpus = load_corpus(args.corpus) if args.corpus else load_data(config.data.corpus, config.data.path)
    ids = vocab.encode(corpus.val)
    density = config.data.meta_density  # a meta-token run is scored as it was trained
    meta = {"meta_density": density, "meta_id": vocab.pause_id} if density > 0 else {}
    result = evaluate_lm(model, ids, seq_len=config.data.seq_len, batch_size=config.train.schedule.batch_size,
                         max_tokens=args.max_tokens, **meta)
    print(json.dumps({"checkpoint": str(path), "step": state.get("step"), "corpus": corpus.name, **result}))
    return 0


def _eval_task_run(args: argparse.Namespace, path: Path, state: dict) -> int:
    """`eval` of a task run: the task's metric (and loss, accuracy, attention FLOPs) on the fixed
    sample of its validation split (or --split test) that training evaluated on (evaluate_on_task)."""
    from routeformer.train.checkpoint import task_model, task_of_run
    from routeformer.train.on_task import evaluate_on_task

    if args.corpus is not None or args.max_tokens is not None:
        raise ValueError("argument --corpus/--max-tokens: apply to LM run directories of the earlier "
                         "layout (config.yaml beside checkpoint.pt); a task run, `routeformer train`'s among "
                         "them, is evaluated on its task's fixed sample (--split, --sequences)")
    model, _ = task_model(state)
    task = task_of_run(state, path)
    split = args.split or "validation"
    setup = state["run"]["setup"]
    sequences = args.sequences or setup["test_sequences" if split == "test" else "validation_sequences"]
    result = evaluate_on_task(model, task, split, sequences)
    print(json.dumps({"checkpoint": str(path), "step": state["step"], "task": task.describe(), "split": split,
                      "sequences": sequences, "metric": task.metric, **result}))
    return 0


def command_sample(args: argparse.Namespace) -> int:
    import torch

    from routeformer.train.checkpoint import is_task_model, task_model, trained_model

    path, state = usable_checkpoint(args.checkpoint)
    if is_task_model(state):
        model, vocab = task_model(state)
        if vocab is None or not hasattr(model, "generate"):
            raise ValueError(f"sample: {args.checkpoint!r} is a run of task {state['task']['name']!r}, whose "
                             "tokens are not text; sample generates from runs of text tasks (lm, code_lm) "
                             "and of `routeformer train`; score this one with `routeformer eval`")
    else:
        model, vocab, _ = trained_model(state)
    if args.temperature is not None and not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0; got {args.temperature!r}")
    if hasattr(vocab, "check_known"):  # a character vocabulary: refuse what it would map to <unk>
        vocab.check_known(args.prompt, "--prompt")
    prompt = vocab.encode(args.prompt)[None]
    if prompt.shape[1] == 0:
        raise ValueError("prompt must not be empty")
    generator = torch.Generator().manual_seed(args.seed)
    tokens = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                            generator=generator)
    print(vocab.decode(tokens[0].tolist()))
    print(f"routeformer: sampled from {str(path)!r} (step {state.get('step')})", file=sys.stderr, flush=True)
    return 0


def command_export_hf(args: argparse.Namespace) -> int:
    from routeformer.train.checkpoint import CheckpointError

    try:
        from routeformer.integrations.hf.export import RUN_NAME, VOCAB_NAME, export_hf
    except ImportError as error:  # transformers is an optional extra
        raise ValueError(str(error)) from error
    try:
        out = export_hf(args.run_dir, args.out_dir)
    except CheckpointError as error:
        raise CheckpointError(with_run_hint(args.run_dir, error)) from None
    source = json.loads((out / RUN_NAME).read_text()) if (out / RUN_NAME).is_file() else {}
    origin = f" from {source['checkpoint']!r} (step {source['step']})" if source else ""
    if (out / VOCAB_NAME).is_file():
        tokens = (f"  (tokeniser: routeformer.data.tokenizers.tokenizer_from_dict(json.load(open("
                  f"{str(out / VOCAB_NAME)!r}))))")
    elif source.get("task"):
        tokens = f"  (no text tokeniser: its input ids are the tokens of task {source['task']['name']!r})"
    else:
        tokens = ""
    print(f"wrote {out}{origin}; load it with (the first import registers routeformer's model with "
          f"transformers):\n"
          f"  import routeformer.integrations.hf\n"
          f"  from transformers import AutoModelForCausalLM\n"
          f"  model = AutoModelForCausalLM.from_pretrained({str(out)!r})" + (f"\n{tokens}" if tokens else ""))
    return 0
