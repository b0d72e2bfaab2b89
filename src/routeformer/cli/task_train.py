"""`routeformer train --task NAME`: one model trained on any registered task, through the run path
compare uses (`compare.budgets.task_job` -> `runner.jobs.train_job` -> `train.on_task.train_on_task`:
`build_task_model`, the task loop, `evaluate_on_task`) in a run directory that resumes
(`runner.run_dir`).

The setup is compare --quick's for the task where it has one (lm, mqar, listops: task options,
schedule, evaluations, test sample) and otherwise the task's own defaults with the task loop's
default schedule; the backbone is compare --quick's. `--budget long` takes compare --long's setup
and backbone instead (its curriculum; the same job compare --long trains for that mechanism and
seed, so the same weights). --steps, --batch-size, --lr, --evals, --seq-len (not with --budget
long) and --option change it (the stage on the task itself); with --steps the warm-up keeps its
share of the steps. The
trained model is kept in the run directory as `checkpoint.pt` (runner/run_dir.py), which `eval`,
`sample` (text tasks), `export-hf` (causal models) and `train.checkpoint.load_run_model` read.
`--precision bf16` trains under bfloat16 autocast, `fp16` under float16 autocast with a gradient
scaler (CUDA only) (train/task_loop.py; fp32 by default);
`--device cuda` (or `auto`: cuda when available) builds, trains and evaluates the model on the GPU
(cuda:LOCAL_RANK under torchrun; default cpu), the batches drawn on the CPU as there, so that a run
sees the same tokens on either device; `--betas B1 B2` sets AdamW's betas (default 0.9 0.999),
`--model.tie_embeddings true` ties the output head to the token embedding (default: a separate
head) and `--model.dropout P` trains with dropout P (default 0). The run directory's
`metrics.jsonl` holds a line per evaluation and a final one (runner/run_dir.py), and with
`--log-every N` a training line every N updates (loss, learning rate, gradient norm, throughput);
`--checkpoint-every N` also checkpoints every N steps between the evaluations (default 0: neither)
and `--keep-checkpoints K` keeps the newest K of them (default 2; all three may change when the run
is resumed); `--logger
tensorboard` also writes them as TensorBoard event files to `DIR/tensorboard`.

`train --task lm --config FILE [--key value ...] [--out DIR]` trains the task-lm run of the LM run
config FILE (a path or a bundled name): the rest of the line is the config's overrides
(`train.load_config`: `--model.dim 64`, `--steps 40`), except `--out`, and the config becomes its
task-lm job by `runner.lm_config.lm_config_job`, which translates every config; the config's
`train.device` is where the run trains, and its `train.logger` the run directory's (`--train.logger
tensorboard`: TensorBoard too). The task-run arguments that are not config keys (--mechanism,
--option, --evals, --budget, --mechanism-option, --betas, --log-every, --checkpoint-every,
--keep-checkpoints) are refused beside --config, each naming the key that states the same; so is
--out_dir (the run directory is --out). `routeformer train [--config FILE] [--key value ...]`
without --task is the same run in the config's out_dir (`--out` or `--out_dir` replace it).

Under torchrun (or RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the environment)
the run trains DistributedDataParallel, as `routeformer train` does (gloo on the CPU, nccl on CUDA):
--batch-size is the global batch, sharded over the processes; process 0 alone evaluates, logs,
writes the run directory and prints the summary.

    torchrun --standalone --nproc_per_node 2 -m routeformer.cli train --task mqar --steps 600
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from routeformer.cli.exit_status import EXIT_INTERRUPTED
from routeformer.cli.parser import DEVICES, build_task_train_parser, key_values
from routeformer.runner.jobs import Job, TaskSetup
from routeformer.train.on_task import mechanism_label


def command_train_task(args: argparse.Namespace, extra: list[str], *, lm_run: bool = False) -> int:
    from routeformer.runner.jobs import say
    from routeformer.runner.run_dir import RECORD_FILE, run_in_directory
    from routeformer.train.checkpoint import CHECKPOINT_NAME
    from routeformer.train.distributed import finish_distributed, init_distributed
    from routeformer.train.task_loop import distributed_training, training_on

    logger = "jsonl"
    if args.spec is not None:
        job, out, device = spec_run_job(args, extra)
        names = ("argument --device", "precision")
    elif args.config is not None:
        job, out, logger, device = config_run_job(args.task, args.config, extra, lm_run=lm_run)
        names = ("train.device", "train.precision")
    else:
        options = build_task_train_parser().parse_args(extra)
        job = task_run_job(args.task, options)
        out, logger, device = options.out, options.logger, options.device
        names = ("argument --device", "argument --precision")
    out = out or f"runs/train-{job.task}-{mechanism_label(job.mechanism)}-seed{job.seed}"
    context = init_distributed(device)
    try:
        check_global_batch(job, context.world_size)
        on = run_device(device, context, names[0])
        if job.precision == "fp16" and on.type != "cuda":
            raise ValueError(f"{names[1]}: 'fp16' needs a CUDA device (float16 autocast with a gradient "
                             f"scaler); on {on.type} use bf16")
        with distributed_training(context), training_on(on):
            record = run_in_directory(out, job, fresh=args.fresh, logger=logger,
                                      log=lambda line: say(f"  {job.key}: {line}"))
    except KeyboardInterrupt:
        if context.is_main:
            print(f"routeformer: interrupted; run the same command again to resume {out!r} (after the step "
                  "Ctrl-C stopped at, or after the last evaluation when it stopped inside a step)",
                  file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        finish_distributed(context)
    if not context.is_main:
        return 0
    kept = Path(out) / CHECKPOINT_NAME
    model = {"checkpoint": str(kept)} if kept.is_file() else {}
    print(json.dumps({"out_dir": out, "record": f"{out}/{RECORD_FILE}", **model, "task": record["task"],
                      "mechanism": record["mechanism"], "seed": record["seed"],
                      "steps": record_steps(record), "parameters": record["parameters"],
                      "quality": record["quality"], "test": record_test(record),
                      "train_seconds": round(record["train_seconds"], 1), "resumed": record["resumed"]}))
    return 0


# the task-run arguments that are not config keys, and what states the same with --config
NOT_WITH_CONFIG = {"--mechanism": "--model.attention", "--mechanism-option": "--model.attention_options",
                   "--option": "--data.KEY", "--evals": "--train.eval_every", "--budget": None,
                   "--betas": "--train.beta1 and --train.beta2", "--out_dir": "--out", "--out-dir": "--out",
                   "--log-every": "--train.log_every", "--checkpoint-every": "--train.checkpoint_every",
                   "--keep-checkpoints": "--train.keep_checkpoints"}


def config_run_job(task: str, config: str, extra: list[str], *,
                   lm_run: bool = False) -> tuple[Job, str | None, str, str]:
    """(job, --out or None, the config's `train.logger`, its `train.device`) of `train --task lm
    --config FILE [--key value ...] [--out DIR]`: the LM run config FILE (a path or a bundled name)
    with the overrides applied as `routeformer train` applies them (`train.load_config`), as its
    task-lm job (`runner.lm_config.lm_config_job`).
    ValueError naming --task unless the task is lm, naming a task-run argument that is not a config
    key (NOT_WITH_CONFIG: it says which key states the same), or as `load_config` raises."""
    from routeformer.cli.config_files import resolve_config
    from routeformer.runner.lm_config import LM_RUN_KEY, lm_config_job, lm_run_key
    from routeformer.train import load_config

    if task != "lm":
        why = (" (code_lm draws its windows inside documents, the LM run anywhere in the text)"
               if task == "code_lm" else "")
        raise ValueError(f"argument --task: with --config the task is lm, the LM run's{why}; got {task!r}")
    overrides, out, index = [], None, 0
    while index < len(extra):
        argument = extra[index]
        name, equals, value = argument.partition("=")
        if name in NOT_WITH_CONFIG and not (lm_run and name == "--out_dir"):
            instead = NOT_WITH_CONFIG[name]
            raise ValueError(f"argument {name}: not with --config (the rest of the line is the config's "
                             "--key value overrides" + (f"; use {instead}" if instead else "") + ")")
        if name == "--out":
            if not equals and index + 1 >= len(extra):
                raise ValueError("argument --out: expected one argument")
            out = value if equals else extra[index + 1]
            index += 1 if equals else 2
            continue
        overrides.append(argument)
        index += 1
    loaded = load_config(resolve_config(config), overrides)
    job = lm_config_job(loaded, LM_RUN_KEY)
    out = loaded.out_dir if lm_run else out
    return replace(job, key=lm_run_key(job)), out, loaded.train.logger, loaded.train.device


def spec_run_job(args: argparse.Namespace, extra: list[str]) -> tuple[Job, str | None, str]:
    """(job, --out or None, --device or "cpu") of `train --spec FILE [--KEY.PATH VALUE ...] [--out DIR]
    [--device NAME]`: the run spec FILE (JSON or YAML, or a run directory's config.json) with the
    dotted overrides set (`runner.spec.load_spec`). ValueError naming --task or --config (not with
    --spec), an override without a value, a --device other than cpu, cuda or auto, or as `load_spec`
    does."""
    from routeformer.runner.spec import load_spec

    for name in ("task", "config"):
        if getattr(args, name) is not None:
            raise ValueError(f"argument --{name}: not with --spec (the spec names the task and the model)")
    overrides, out, device, index = [], None, "cpu", 0
    while index < len(extra):
        name, equals, value = extra[index].partition("=")
        if not name.startswith("--") or len(name) < 3:
            raise ValueError(f"argument {extra[index]!r}: with --spec, the rest of the line is "
                             "--KEY.PATH VALUE overrides of the spec (and --out DIR)")
        if not equals:
            if index + 1 >= len(extra) or extra[index + 1].startswith("--"):
                raise ValueError(f"argument {name}: expected one argument")
            value = extra[index + 1]
        index += 1 if equals else 2
        if name == "--out":
            out = value
        elif name == "--device":
            if value not in DEVICES:
                raise ValueError(f"argument --device: one of {list(DEVICES)}; got {value!r}")
            device = value
        else:
            overrides.append((name[2:], value))
    return load_spec(args.spec, overrides), out, device


def run_device(name: str, context: Any, argument: str) -> Any:
    """The torch device a task run trains on for `name` (one of DEVICES; cuda: this process's
    LOCAL_RANK under torchrun; auto: cuda when available). ValueError as `available_device`."""
    from routeformer.train.distributed import resolve_device

    return resolve_device(available_device(name, argument), context)


def available_device(name: str, argument: str) -> str:
    """"cpu" or "cuda" for `name` (one of DEVICES; auto: cuda when available). ValueError naming
    `argument` when it asks for CUDA and none is available."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{argument}: 'cuda' but no CUDA device is available; use cpu or auto")
    return name


def check_global_batch(job: Job, processes: int) -> None:
    """ValueError naming --batch-size unless every stage's batch (the global batch) divides evenly
    over `processes`."""
    for stage in job.setup.stages:
        if stage.schedule.batch_size % processes:
            raise ValueError(f"argument --batch-size: the global batch ({stage.schedule.batch_size}) is "
                             f"split over the {processes} processes and must be divisible by their number")


def record_steps(record: dict) -> int:
    """Training steps of a task run's record: the stages' steps summed for a curriculum run, the last
    evaluation's step otherwise."""
    if record.get("stages"):
        return sum(stage["schedule"]["steps"] for stage in record["stages"])
    return record["validation"][-1]["step"]


def record_test(record: dict) -> dict:
    """The test metrics of a task run's record: {name: value} for a single-stage run, {length:
    {name: value}} for a curriculum run (tested at T and at longer lengths)."""
    if "tests" in record:
        return {length: {key: value for key, value in metrics.items() if not isinstance(value, dict)}
                for length, metrics in record["tests"].items()}
    return {key: value for key, value in record["test"].items() if not isinstance(value, dict)}


def task_run_job(task: str, options: argparse.Namespace) -> Job:
    """The compare job the command line asks for (ValueError naming the argument when it is bad)."""
    from routeformer.attention import baseline_name, list_attentions
    from routeformer.compare.budgets import LONG, QUICK, lm_only, task_job
    from routeformer.tasks import list_tasks
    from routeformer.train.task_loop import TaskTrainConfig

    tasks = list_tasks()
    budget = QUICK if options.budget == "quick" else LONG
    if options.budget == "long":
        if task not in LONG.tasks:
            raise ValueError(f"argument --task: --budget long has the tasks {list(LONG.tasks)}; got {task!r}")
        if options.seq_len is not None:
            raise ValueError("argument --seq-len: --budget long trains at its own lengths (its curriculum)")
        name = LONG.tasks[task].task_name(task)
        tasks = {**tasks, task: tasks[name]}
    if task not in tasks:
        raise ValueError(f"argument --task: unknown task {task!r}; registered: {sorted(tasks)}")
    mechanisms = sorted(list_attentions())
    mechanism = options.mechanism or baseline_name()
    if mechanism not in mechanisms:
        raise ValueError(f"argument --mechanism: unknown mechanism {mechanism!r}; registered: {mechanisms}")
    setup = budget.tasks.get(task) or TaskSetup({}, TaskTrainConfig().schedule)
    task_options = {**setup.options, **_task_options(task, tasks[task], options)}
    if lm_only(mechanism) and "meta_density" not in tasks[task]:
        with_meta = sorted(name for name, known in tasks.items() if "meta_density" in known)
        raise ValueError(f"argument --mechanism: {mechanism!r} needs injected meta-tokens, which task "
                         f"{task!r} has not; tasks that have them: {with_meta}")
    schedule = setup.schedule
    if options.steps is not None:
        warmup = round(schedule.warmup_steps * options.steps / schedule.steps)
        schedule = replace(schedule, steps=options.steps, warmup_steps=min(options.steps, max(1, warmup)))
    if options.batch_size is not None:
        schedule = replace(schedule, batch_size=options.batch_size)
    if options.lr is not None:
        schedule = replace(schedule, lr=options.lr)
    chosen = _mechanism_options(mechanism, options.mechanism_option)
    recipes = setup.mechanism_options
    if chosen:
        recipes = {**recipes, mechanism: {**recipes.get(mechanism, {}), **chosen}}
    setup = replace(setup, options=task_options, schedule=schedule, evals=options.evals or setup.evals,
                    mechanism_options=recipes)
    job = task_job(f"train-{task}-{mechanism}-seed{options.seed}", task, mechanism, options.seed, setup,
                   _model_spec(budget.spec, options))
    betas = {} if options.betas is None else {"betas": tuple(options.betas)}
    return replace(job, precision=options.precision, log_every=options.log_every,
                   checkpoint_every=options.checkpoint_every, keep_checkpoints=options.keep_checkpoints,
                   **betas)


MODEL_KEYS = ("dim", "depth", "heads", "mlp_ratio", "positions", "tie_embeddings", "dropout")


def model_changes(options: argparse.Namespace) -> dict[str, Any]:
    """The backbone fields the line's --model.KEY arguments set (`parser.add_model_arguments`)."""
    return {key: getattr(options, f"model_{key}") for key in MODEL_KEYS
            if getattr(options, f"model_{key}") is not None}


def _model_spec(spec, options: argparse.Namespace):
    """The budget's backbone with the --model.KEY overrides (ValueError naming a bad one)."""
    from routeformer.train.on_task import spec_with

    try:
        return spec_with(spec, model_changes(options))
    except ValueError as error:
        raise ValueError(f"argument --{error}") from None


def _mechanism_options(mechanism: str, items: list[str]) -> dict[str, Any]:
    """The layer options --mechanism-option sets (ValueError naming an option the layer has not)."""
    from routeformer.attention.registry import attention_options

    accepted = sorted(attention_options(mechanism))
    return key_values(items, "--mechanism-option", accepted,
                      f" with KEY an option of {mechanism!r} {accepted}")


def _task_options(task: str, known: dict[str, Any], options: argparse.Namespace) -> dict[str, Any]:
    """The task options --seq-len and --option set."""
    chosen = key_values(options.option, "--option", known,
                        f" with KEY an option of task {task!r} {sorted(known)}")
    if options.seq_len is not None:
        if "seq_len" not in known:
            raise ValueError(f"argument --seq-len: task {task!r} has no seq_len option (its length follows "
                             f"from {sorted(known)}; set them with --option KEY=VALUE)")
        chosen["seq_len"] = options.seq_len
    return chosen
