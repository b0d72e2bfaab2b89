"""The commands that train a model or use a trained one: compare, train, eval, sample and export-hf,
with the config and checkpoint lookups they share."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from routeformer.cli.exit_status import EXIT_INTERRUPTED

# the bundled YAML configs live beside the package's modules, one folder above this one
CONFIG_DIR = Path(__file__).parent.parent / "configs"


def resolve_config(name_or_path: str) -> Path:
    """A path to a YAML file, or the name of a config shipped in routeformer/configs."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = CONFIG_DIR / f"{name_or_path}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ValueError(f"config {name_or_path!r} is neither a file nor a bundled config; bundled: {names}")


def command_compare(args: argparse.Namespace) -> int:
    from routeformer.compare.run import run_compare

    try:
        if args.long:
            report = _compare_long(args)
        else:
            report = run_compare(args.out or "runs/compare", mechanisms=args.mechanisms, tasks=args.tasks,
                                 quick=args.quick, corpus=args.corpus or "pydoc", bench=not args.no_bench,
                                 seeds=args.seeds, workers=args.workers)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(report.read_text())
    print(f"wrote {report.parent}/ (report.md, result.json, PNGs)")
    return 0


def _compare_long(args: argparse.Namespace):
    """`compare --long`: compare's LONG budget (compare/budgets.py)."""
    from routeformer.compare.budgets import LONG, check_long_selection
    from routeformer.compare.run import run_compare

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
        f" --corpus {args.corpus}" if args.corpus else ""])
    out = args.out or "runs/compare-long"
    return run_compare(out, mechanisms=mechanisms, tasks=tasks, budget=LONG, seeds=args.seeds,
                       workers=args.workers, corpus=args.corpus, command=command)


def command_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from routeformer.cli.parser import DEFAULT_CONFIG
    from routeformer.train import load_config, train
    from routeformer.train.interrupts import RunInterrupted

    if args.task is not None:  # any registered task, through compare's run path
        from routeformer.cli.task_train import command_train_task

        return command_train_task(args, overrides)
    config = load_config(resolve_config(args.config or DEFAULT_CONFIG), overrides)
    try:
        result = train(config, resume=not args.fresh)
    except RunInterrupted as interrupted:  # one line saying what was saved (rank 0 of torchrun only)
        if str(interrupted):
            print(f"routeformer: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("routeformer: interrupted before training began; run again to resume or start",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if result.final_eval is not None:  # under torchrun, rank 0 alone evaluates and reports
        skipped = {"skipped_steps": result.skipped_steps} if result.skipped_steps else {}
        print(json.dumps({"out_dir": str(result.out_dir), "steps": result.step,
                          "train_seconds": round(result.train_seconds, 1), **skipped, **result.final_eval}))
    return 0


def load_for_use(target: str):
    """(model, tokeniser, config, checkpoint file, step) for eval and sample. CheckpointError when
    a run directory's newest checkpoint is unreadable: an older state is used only when its file is
    named explicitly."""
    from routeformer.train.checkpoint import CheckpointError, choose_checkpoint, trained_model

    path, state, unreadable = choose_checkpoint(target)
    step = state.get("step")
    if unreadable:
        raise CheckpointError(
            f"the newest checkpoint of {target!r} is unreadable ({unreadable}); its newest intact one is "
            f"{str(path)!r} (step {step}), an older state: name that file to use it")
    return (*trained_model(state), path, step)


def command_eval(args: argparse.Namespace) -> int:
    from routeformer.data.corpora import load_corpus, load_data
    from routeformer.train.evaluate import evaluate_lm

    model, vocab, config, path, step = load_for_use(args.checkpoint)
    corpus = load_corpus(args.corpus) if args.corpus else load_data(config.data.corpus, config.data.path)
    ids = vocab.encode(corpus.val)
    density = config.data.meta_density  # a meta-token run is scored as it was trained
    meta = {"meta_density": density, "meta_id": vocab.pause_id} if density > 0 else {}
    result = evaluate_lm(model, ids, seq_len=config.data.seq_len, batch_size=config.train.schedule.batch_size,
                         max_tokens=args.max_tokens, **meta)
    print(json.dumps({"checkpoint": str(path), "step": step, "corpus": corpus.name, **result}))
    return 0


def command_sample(args: argparse.Namespace) -> int:
    import torch

    model, vocab, _, path, step = load_for_use(args.checkpoint)
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
    print(f"routeformer: sampled from {str(path)!r} (step {step})", file=sys.stderr, flush=True)
    return 0


def command_export_hf(args: argparse.Namespace) -> int:
    try:
        from routeformer.integrations.hf.export import export_hf
    except ImportError as error:  # transformers is an optional extra
        raise ValueError(str(error)) from error
    out = export_hf(args.run_dir, args.out_dir)
    print(f"wrote {out}; load it with (the first import registers routeformer's model with transformers):\n"
          f"  import routeformer.integrations.hf\n"
          f"  from transformers import AutoModelForCausalLM\n"
          f"  model = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
          f"  (tokeniser: routeformer.data.tokenizers.tokenizer_from_dict(json.load(open("
          f"{str(out / 'routeformer_vocab.json')!r}))))")
    return 0

