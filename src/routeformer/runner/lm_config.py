"""The LM run of a config: `lm_config_job(config, key)` states what `routeformer train --config FILE`
trains, a one-stage job on task lm (`runner.jobs.train_job`, the path of compare and every task
run), and `train_lm_config(config)` (`routeformer.train.train`) trains it in `config.out_dir`.

What carries over: the backbone (`model.dim`, `depth`, `heads`, `mlp_ratio`, `positions`,
`tie_embeddings`, `dropout`: torch's RNG is seeded after the model is built, so the masks follow
from the seed; `max_seq_len` where learned positions need a table longer than `data.seq_len`;
`zero_meta_positions_train` / `_eval`), the mechanism (`model.attention`: one name, or a list with a
name per layer, which becomes the job's list of layer mechanisms) and its `model.attention_options`
(of the one mechanism, or keyed by the layers' mechanisms), the text and `data.seq_len` (task
options `corpus`, `seq_len`, and `meta_density` when above 0, `path` for a `data.path`, `tokenizer`
for a `data.tokenizer` other than "char" and `pack_documents` when set), the whole schedule
(`train.steps`, `batch_size`, `lr`, `warmup_steps`, `min_lr_ratio`, `grad_clip`),
`train.weight_decay`, `train.beta1`/`beta2`, `train.seed`, `train.max_nonfinite_steps`,
`train.precision` (fp32, bf16, or fp16 on CUDA), `train.device` (where the run trains: the caller's
`train.task_loop.training_on`) and the evaluation steps (`train.eval_every`: `steps // eval_every`
evaluations where it divides the steps, else the setup's `eval_every`).

The evaluations: a periodic one reads about `train.eval_tokens` tokens of task lm's validation
split (`eval_tokens // T'` windows, T' the real tokens of a window), the test after training about
`train.final_eval_tokens` tokens of its test split (None: every window of it); the two splits are
the halves of the corpus's held-out text, or a corpus's own two splits. The run checkpoints at each
evaluation and every `train.checkpoint_every` steps (keeping the newest `train.keep_checkpoints`),
writes a training line to metrics.jsonl every `train.log_every` updates, and logs to `train.logger`
(the run directory's logger, not part of the job). `model.vocab_size` follows the tokeniser;
`model.num_classes` and `pooling` belong to the classification head, which an LM does not build.

`train.log_stats` (layer statistics) become the job's `log_stats`: each evaluation record holds the
training step's statistics at that step. `lm_config_job` translates every RunConfig: nothing a
config can say is refused."""

from __future__ import annotations

from typing import Any

from routeformer.runner.jobs import Job
from routeformer.runner.setups import TaskSetup
from routeformer.train.on_task import ModelSpec

__all__ = ["LM_RUN_KEY", "lm_config_job", "lm_run_as_task_run", "train_lm_config"]


def lm_config_job(config: Any, key: str) -> Job:
    """The one-stage task-lm `Job` named `key` that trains the model `routeformer train` trains from
    the RunConfig `config` (module docstring: what maps, what does not apply).

    Every RunConfig translates; raises TypeError unless `config` is a `train.config.RunConfig`."""
    from routeformer.tasks.meta_tokens import real_tokens_per_window
    from routeformer.train.config import RunConfig

    if not isinstance(config, RunConfig):
        raise TypeError("config: a routeformer.train.config.RunConfig (load_config); "
                        f"got {type(config).__name__}")
    model, data, run = config.model, config.data, config.train
    layers = model.layer_attention()
    mechanism: str | list[str] = layers[0] if len(set(layers)) == 1 else layers
    if isinstance(mechanism, str):
        options_of = dict(model.attention_options.get(mechanism, {}))
    else:  # keyed by the layers' mechanisms, as the config's attention_options are
        options_of = {name: dict(values) for name, values in model.attention_options.items()
                      if name in layers and values}
    options: dict[str, Any] = {"corpus": data.corpus, "seq_len": data.seq_len}
    if data.meta_density > 0:
        options["meta_density"] = data.meta_density
    if data.path:  # named only when set, so the jobs of other configs stay as they were
        options["path"] = data.path
    if data.tokenizer != "char":
        options["tokenizer"] = data.tokenizer
    if data.pack_documents:
        options["pack_documents"] = True
    real = real_tokens_per_window(data.seq_len, data.meta_density)
    steps = run.schedule.steps
    # eval_every only where it does not divide the steps, so the jobs of other configs stay as they were
    setup = TaskSetup(options, run.schedule, evals=max(1, steps // run.eval_every),
                      eval_every=run.eval_every if steps % run.eval_every else 0,
                      validation_sequences=max(1, run.eval_tokens // real),
                      test_sequences=_test_windows(options, real, run.final_eval_tokens))
    longer = model.positions == "learned" and model.max_seq_len > data.seq_len  # a larger position table
    spec = ModelSpec(dim=model.dim, depth=model.depth, heads=model.heads, mlp_ratio=model.mlp_ratio,
                     positions=model.positions, tie_embeddings=model.tie_embeddings, dropout=model.dropout,
                     max_seq_len=model.max_seq_len if longer else 0,
                     zero_meta_positions_train=model.zero_meta_positions_train,
                     zero_meta_positions_eval=model.zero_meta_positions_eval)
    return Job(key, "lm", dict(options), mechanism, options_of,
               run.seed, setup, spec, precision=run.precision, betas=(run.beta1, run.beta2),
               weight_decay=run.weight_decay, max_nonfinite_steps=run.max_nonfinite_steps,
               log_stats=list(run.log_stats), log_every=run.log_every,
               checkpoint_every=run.checkpoint_every, keep_checkpoints=run.keep_checkpoints)


LM_RUN_KEY = "train-lm"  # the job key of an LM run directory, before the mechanism and seed


def lm_run_key(job: Job) -> str:
    """The key of an LM run's job in its run directory: `train-lm-<mechanism>-seed<seed>`."""
    from routeformer.train.on_task import mechanism_label

    return f"{LM_RUN_KEY}-{mechanism_label(job.mechanism)}-seed{job.seed}"


def train_lm_config(config: Any, *, resume: bool = True, quiet: bool = False) -> Any:
    """Train the LM run `config` (a RunConfig) in `config.out_dir` as the one-stage task-lm job
    `lm_config_job` makes of it (`runner.run_dir.run_in_directory`: resumes an interrupted run,
    reads back a finished one, trains a finished one on when `train.steps` grew), on
    `config.train.device`, under torchrun DistributedDataParallel when launched so (the batch the
    global batch); progress lines go to stderr unless `quiet`. `resume=False` starts over
    (`--fresh`). Returns a `train.result.TrainResult`.

    Raises TypeError unless `config` is a RunConfig; ValueError as `run_in_directory` does, when the
    batch does not divide over the processes, or when the device or precision is not available."""
    from dataclasses import replace
    from pathlib import Path

    from routeformer.runner.jobs import say
    from routeformer.runner.run_dir import METRICS_FILE, run_in_directory
    from routeformer.train.checkpoint import load_run_model
    from routeformer.train.distributed import (
        check_shardable,
        finish_distributed,
        init_distributed,
        resolve_device,
    )
    from routeformer.train.precision import check_precision
    from routeformer.train.progress import read_records
    from routeformer.train.result import TrainResult
    from routeformer.train.task_loop import distributed_training, training_on

    job = lm_config_job(config, LM_RUN_KEY)
    job = replace(job, key=lm_run_key(job))
    out_dir = Path(config.out_dir)
    context = init_distributed(config.train.device)
    try:
        check_shardable(config.train.schedule.batch_size, context)
        device = resolve_device(config.train.device, context)
        check_precision(config.train.precision, device)
        log = None if quiet else (lambda line: say(f"  {job.key}: {line}"))
        with distributed_training(context), training_on(device):
            record = run_in_directory(out_dir, job, fresh=not resume, logger=config.train.logger, log=log)
    finally:
        finish_distributed(context)
    steps = config.train.schedule.steps
    if not record:  # a process other than 0 under torchrun
        return TrainResult(steps, None, None, None, out_dir, 0.0)
    run = load_run_model(out_dir, build_task=False)
    test = {key: value for key, value in record["test"].items() if not isinstance(value, dict)}
    skipped = sum("skipped" in line for line in read_records(out_dir / METRICS_FILE))
    return TrainResult(steps, test, run.model, run.tokenizer, out_dir, record["train_seconds"], skipped,
                       record)


def lm_run_as_task_run(run: Any) -> Any:
    """An LM run directory of the earlier layout (`train.checkpoint.load_run_model`'s RunModel with
    `task` None and a RunConfig's dict as `config`) as the task run of its `lm_config_job`: the same
    model and weights, with `task` (task lm with the config's corpus and length) and `config` (the
    job, as a task run's config.json holds it) — what `routeformer sparsify` reads from a task run.
    A run with a task is returned as it is.

    Raises ValueError when its tokeniser is not the task's (the corpus changed since the run was
    trained)."""
    from dataclasses import replace

    from routeformer.runner.jobs import built_task, job_config
    from routeformer.train.config import RunConfig

    if run.task is not None:
        return run
    job = lm_config_job(RunConfig.from_dict(run.config), "lm-run")
    task = built_task(job)
    if run.tokenizer is None or run.tokenizer.to_dict() != task.vocab.to_dict():
        source = job.task_options.get("path", job.task_options["corpus"])
        raise ValueError(f"the run's tokeniser is not task lm's for {source!r} (the text or the tokenizer "
                         "changed since the run was trained)")
    return replace(run, task=task, config=job_config(job))


def _test_windows(options: dict[str, Any], real: int, tokens: int | None) -> int:
    """Test windows of about `tokens` tokens (`real` per window); None: every window of the test
    split of task lm built with `options`."""
    if tokens is not None:
        return max(1, tokens // real)
    from routeformer.tasks import build_task

    return max(1, (len(build_task("lm", **options).ids("test")) - 1) // real)
