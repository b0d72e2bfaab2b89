"""The task job of an LM run config: `lm_config_job(config, key)` states what `routeformer train --config
FILE` (train/loop.py) trains as a one-stage job on task lm (`runner.jobs.train_job`, the path of
compare and `routeformer train --task`), so that both train the same weights.

What carries over: the backbone (`model.dim`, `depth`, `heads`, `mlp_ratio`, `positions`,
`tie_embeddings`, `dropout`: both paths seed torch's RNG after building the model, so they draw the
same masks; `max_seq_len` where learned positions need a table longer than `data.seq_len`;
`zero_meta_positions_train` / `_eval`), the mechanism (`model.attention`: one name, or a list with a
name per layer, which becomes the job's list of layer mechanisms) and its `model.attention_options`
(of the one mechanism, or keyed by the layers' mechanisms), the text and `data.seq_len` (task
options `corpus`, `seq_len`, and `meta_density` when above 0, `path` for a `data.path`, `tokenizer`
for a `data.tokenizer` other than "char" and `pack_documents` when set: the task then reads, and
packs, the training ids the LM run reads), the whole schedule (`train.steps`, `batch_size`, `lr`,
`warmup_steps`, `min_lr_ratio`, `grad_clip`), `train.weight_decay`, `train.beta1`/`beta2`,
`train.seed`, `train.max_nonfinite_steps`, `train.precision` (fp32, bf16, or fp16 on CUDA),
`train.device` (where the task run trains: the caller's `train.task_loop.training_on`) and the
evaluation steps (`train.eval_every`: `steps // eval_every` evaluations where it divides the steps,
else the setup's `eval_every`).

What is read differently, without changing the weights: a periodic evaluation reads about
`train.eval_tokens` tokens of the task's validation split (`eval_tokens // T'` windows, T' the real
tokens of a window) and the test after training about `train.final_eval_tokens` tokens of its test
split (None: every window of it), where the LM run reads its whole held-out text (the task's
validation and test splits are the two halves of it, or a corpus's own two splits); the task run
checkpoints at each evaluation and every `train.checkpoint_every` steps (keeping the newest
`train.keep_checkpoints`, as the LM run does), writes a training line to metrics.jsonl every
`train.log_every` updates, and keeps its model as a run directory (runner/run_dir.py), so `out_dir`
does not apply to it.
`train.logger` is the run directory's logger, not part of the job (`routeformer train --task lm
--config` passes it to `runner.run_dir.run_in_directory`). `model.vocab_size` follows the tokeniser on
both paths; `model.num_classes` and `pooling` belong to the classification head, which neither builds.

`train.log_stats` (the layer statistics the LM run logs every `log_every` steps) become the job's
`log_stats`: each evaluation record holds the training step's statistics at that step.
`lm_config_job` translates every RunConfig: nothing a config can say is refused."""

from __future__ import annotations

from typing import Any

from routeformer.runner.jobs import Job
from routeformer.runner.setups import TaskSetup
from routeformer.train.on_task import ModelSpec

__all__ = ["lm_config_job", "lm_run_as_task_run"]


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
    else:  # keyed by the layers' mechanisms, as the LM run's attention_options are
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


def lm_run_as_task_run(run: Any) -> Any:
    """A `routeformer train` LM run (`train.checkpoint.load_run_model`'s RunModel with `task` None)
    as the task run of its `lm_config_job`: the same model and weights, with `task` (task lm with
    the config's corpus and length) and `config` (the job, as a task run's config.json holds it) —
    what `routeformer sparsify` reads from a task run. A task run is returned as it is.

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
