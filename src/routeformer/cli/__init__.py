"""The `routeformer` command.

    routeformer compare [--quick | --long] [--mechanisms NAME ...] [--tasks lm mqar listops] [--corpus SPEC]
                        [--seeds N] [--workers N] [--out DIR] [--no-bench]
    routeformer train [--config NAME|PATH] [--fresh] [--key value ...]
    routeformer train --task NAME [--mechanism M] [--seq-len T] [--option KEY=VALUE ...] [--steps N]
                      [--batch-size N] [--lr LR] [--evals N] [--seed S] [--precision fp32|bf16]
                      [--betas B1 B2] [--model.KEY VALUE ...] [--logger jsonl|tensorboard] [--out DIR]
                      [--fresh]
    routeformer train --task lm --config NAME|PATH [--key value ...] [--out DIR] [--fresh]
    routeformer train --spec FILE|RUN_DIR [--KEY.PATH VALUE ...] [--out DIR] [--fresh]
    routeformer eval RUN_OR_CHECKPOINT [--corpus SPEC] [--max-tokens N] [--split S] [--sequences N]
    routeformer sample RUN_OR_CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]
    routeformer sparsify SRC --mechanism topk [--option KEY=VALUE ...] [--steps N] [--sparse-steps M]
                         [--lr X] [--sparse-lr X] [--batch-size B] [--seed S] --out DIR
    routeformer list
    routeformer bench ops|layers|topk|structural|meta|mita|meta_tokens|compile|generate|gpu
                      [--lengths 1024 4096 16384] [--repeats 5] [--window 256] [--output FILE]
    routeformer reproduce NAME [--quick] [--out DIR]      (routeformer reproduce --list)
    routeformer doctor [--length N]
"""

from __future__ import annotations

import sys

from routeformer._startup import interrupt_as_one_line

with interrupt_as_one_line():  # Ctrl-C while the commands' modules import: one line, exit 130
    from routeformer.cli.bench_command import command_bench
    from routeformer.cli.catalogue_commands import command_doctor, command_list, command_reproduce
    from routeformer.cli.config_files import CONFIG_DIR, resolve_config
    from routeformer.cli.exit_status import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED
    from routeformer.cli.model_commands import (
        command_compare,
        command_eval,
        command_export_hf,
        command_sample,
        command_train,
        load_for_use,
    )
    from routeformer.cli.parser import (
        DEFAULT_CONFIG,
        UsageError,
        build_parser,
        non_negative_float,
        non_negative_int,
        positive_int,
    )
    from routeformer.cli.sparsify_command import command_sparsify
del interrupt_as_one_line

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_CONFIG",
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "UsageError",
    "build_parser",
    "load_for_use",
    "main",
    "non_negative_float",
    "non_negative_int",
    "positive_int",
    "resolve_config",
]


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad input ends in one line `routeformer: error: ...` and exit status 2,
    never a traceback (the error types below are the ones bad input raises); Ctrl-C at any moment
    ends in one line and exit status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("routeformer: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    from routeformer.train.checkpoint import CheckpointError
    from routeformer.train.guard import TrainingDiverged

    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "train":
            parser.error(f"unrecognised arguments: {' '.join(extra)}")
        if args.command == "train":
            return command_train(args, extra)
        handlers = {"compare": command_compare, "eval": command_eval, "sample": command_sample,
                    "list": command_list, "bench": command_bench, "reproduce": command_reproduce,
                    "export-hf": command_export_hf, "doctor": command_doctor,
                    "sparsify": command_sparsify}
        return handlers[args.command](args)
    except (ValueError, CheckpointError) as error:
        return _fail(error, EXIT_BAD_INPUT)
    except OSError as error:  # a path that cannot be read or written: says which and why
        return _fail(error, EXIT_BAD_INPUT)
    except TrainingDiverged as error:
        return _fail(error, EXIT_FAILED)


def _fail(error: BaseException, status: int) -> int:
    message = " ".join(str(error).split())  # one line, whatever the exception held
    print(f"routeformer: error: {message or type(error).__name__}", file=sys.stderr)
    return status

