"""`routeformer sparsify SRC --mechanism NAME --out DIR`: a trained dense task run converted into a
routed one by train/sparsify.py's two stages (an LM run directory of the earlier layout converts as
the task-lm run its config translates to: `runner.lm_config.lm_run_as_task_run`), written as a task run
directory (`checkpoint.pt` through `save_task_model`, and `record.json`) that `eval`, `sample`,
`export-hf` and `load_run_model` read. Everything is checked and trained before DIR is created: a refused
command writes nothing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SOURCE_KINDS = ("SRC must be a run directory of `routeformer train --task NAME` or `routeformer train`, or "
                "its checkpoint file")


def layer_options(items: list[str]) -> dict[str, Any]:
    """{KEY: VALUE} from --option's ["KEY=VALUE", ...] (cli.parser.key_values)."""
    from routeformer.cli.parser import key_values

    return key_values(items, "--option")


def _check_options(mechanism: str, options: dict[str, Any]) -> None:
    """ValueError naming an option the routed layer does not take."""
    from routeformer.attention.registry import attention_options

    accepted = set(attention_options(mechanism))
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"argument --option: {mechanism!r} has no option {unknown[0]!r}; its options: "
                         f"{sorted(accepted)}")


def command_sparsify(args: argparse.Namespace) -> int:
    from routeformer.train.checkpoint import CHECKPOINT_NAME, load_run_model, save_task_model
    from routeformer.train.sparsify import (
        STAGE1_LR,
        STAGE2_LR_SHARE,
        check_mechanism,
        check_source,
        convert_on_task,
        default_steps,
        run_tokens,
        stage_options,
    )

    out = Path(args.out)
    if out.exists():
        raise ValueError(f"argument --out: {str(out)!r} exists; name a new directory")
    check_mechanism(args.mechanism)
    options = layer_options(args.option)
    _check_options(args.mechanism, options)
    source = Path(args.source)
    if not source.exists():
        raise ValueError(f"SRC {str(source)!r} does not exist; {SOURCE_KINDS}")
    if source.is_dir() and (source / "config.json").is_file() and not list(source.glob("checkpoint*.pt")):
        raise ValueError(f"SRC {str(source)!r} is a transformers model directory, which converts in Python "
                         f"(routeformer.integrations.hf.sparsify_pretrained), not here; {SOURCE_KINDS}")
    run = load_run_model(source)
    if run.task is None:  # an LM run of the earlier layout: converted as the task-lm run it equals
        from routeformer.runner.lm_config import lm_run_as_task_run

        try:
            run = lm_run_as_task_run(run)
        except ValueError as error:
            raise ValueError(f"SRC {str(source)!r} is an LM run of the earlier layout that does not convert "
                             f"as task lm: {error}") from None
    check_source(run.model)
    schedule = run.config.get("setup", {}).get("schedule", {})
    steps = args.steps if args.steps is not None else default_steps(run.step, args.mechanism)
    stage_options(args.mechanism, options, steps)  # refuses options the conversion sets itself
    batch_size = args.batch_size or schedule.get("batch_size", 32)
    sparse_lr = args.sparse_lr or STAGE2_LR_SHARE * schedule.get("lr", 3e-3)
    routed, conversion = convert_on_task(
        run.model, run.task, args.mechanism, options=options, steps=steps, sparse_steps=args.sparse_steps,
        batch_size=batch_size, lr=args.lr or STAGE1_LR, sparse_lr=sparse_lr, seed=args.seed,
        log=lambda line: print(f"  sparsify: {line}", flush=True))
    from routeformer.train.on_task import evaluate_on_task

    test = evaluate_on_task(routed, run.task, "test", run.config.get("setup", {}).get("test_sequences", 1024))
    source_tokens = run_tokens(run.config, run.task.seq_len)
    conversion.update({
        "source": str(source), "source_checkpoint": str(run.checkpoint), "source_step": run.step,
        "source_tokens": source_tokens,
        "tokens_fraction_of_source": conversion["tokens"] / source_tokens if source_tokens else None,
        "test": test, "quality": test[run.task.metric], "metric": run.task.metric})
    task_config = run.config
    job = {**{key: value for key, value in task_config.items() if key not in ("mechanism", "options")},
           "mechanism": args.mechanism, "options": conversion["options"], "seed": args.seed,
           "sparsify": {key: value for key, value in conversion.items() if key != "test"}}
    vocab = run.tokenizer.to_dict() if run.tokenizer is not None else None
    out.mkdir(parents=True)
    steps_done = run.step + steps + args.sparse_steps
    save_task_model(out, routed, step=steps_done,
                    task=task_config["task"], task_options=task_config["task_options"], run=job, vocab=vocab)
    (out / "record.json").write_text(json.dumps(conversion, indent=2) + "\n")
    print(json.dumps({"out_dir": str(out), "checkpoint": str(out / CHECKPOINT_NAME),
                      "record": str(out / "record.json"), "mechanism": args.mechanism,
                      "source_step": run.step, "steps": steps, "sparse_steps": args.sparse_steps,
                      "tokens": conversion["tokens"],
                      "tokens_fraction_of_source": conversion["tokens_fraction_of_source"],
                      "metric": run.task.metric, "quality": conversion["quality"],
                      "routing_recall": test.get("routing_recall")}))
    return 0
