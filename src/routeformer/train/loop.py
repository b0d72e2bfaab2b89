"""`routeformer train`: a language model trained in a run directory, with periodic evaluation and
exact resume. The steps run through the training driver every task run shares (train/driver.py:
AdamW, the batch generator, the non-finite guard, DistributedDataParallel, the one loop of
train/steps.py); the windows are the LM task's (`tasks.lm.lm_windows`).

A run lives in `config.out_dir`: `config.yaml`, `metrics.jsonl`, `checkpoint.pt` and the previous
`train.keep_checkpoints - 1` checkpoints (`checkpoint.1.pt`, ...; checksummed, written atomically:
train/checkpoint.py). Starting a run whose directory holds a checkpoint resumes from the newest
intact one (unless `resume=False`, which deletes them); the resumed run is bit-identical to one
that was never interrupted, because the checkpoint carries the model, optimizer, step, tokeniser
and the state of every random generator the loop uses (every rank's, under torchrun). Resuming
with a changed config: see train/resume.py. A step with a non-finite loss or gradient is skipped
(train/guard.py). Ctrl-C stops the run at the next step boundary and saves a checkpoint there, the
same one a periodic checkpoint at that step would be (train/interrupts.py); a second Ctrl-C stops
at once, keeping the last checkpoint. A run that already finished is not trained or evaluated
again: its recorded final evaluation is returned.

The text is `data.path` (a local file or folder) or the `data.corpus` spec (data/corpora.py),
tokenised by `data.tokenizer` (characters, or a BPE tokenizer.json: data/tokenizers.py) through the
on-disk cache of tokenised corpora (data/token_cache.py). Metrics go to metrics.jsonl and, with
`train.logger: tensorboard`, to TensorBoard too (train/logging.py).

Under `torchrun` the same loop runs DistributedDataParallel (see train/distributed.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TrainResult", "train", "training_batch"]

import torch

from routeformer.data.corpora import load_data
from routeformer.data.documents import DOCUMENT_SEPARATOR, document_starts, packed_random_batch
from routeformer.data.token_cache import tokenise_corpus
from routeformer.data.tokenizers import Tokenizer, build_tokenizer, tokenizer_from_dict
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.tasks.lm import lm_windows
from routeformer.train.checkpoint import save_rotating
from routeformer.train.config import RunConfig
from routeformer.train.distributed import (
    DistributedContext,
    any_rank,
    check_shardable,
    finish_distributed,
    gather_rng_states,
    init_distributed,
    local_shard,
    mean_over_ranks,
    resolve_device,
)
from routeformer.train.driver import Driver
from routeformer.train.evaluate import evaluate_lm
from routeformer.train.interrupts import (
    DeferredInterrupts,
    InterruptedMidStep,
    RunInterrupted,
    interrupted_message,
)
from routeformer.train.logging import RunLog
from routeformer.train.precision import check_precision, gradient_scaler
from routeformer.train.progress import Progress, peak_memory_mib
from routeformer.train.resume import (
    check_changes,
    check_out_dir,
    config_changes,
    describe,
    find_resume_state,
    recorded_final,
    write_config,
)
from routeformer.train.steps import StepResult


@dataclass
class TrainResult:
    step: int
    final_eval: dict[str, float] | None
    model: CausalLM
    vocab: Tokenizer  # CharVocab (data.tokenizer "char") or BPETokenizer
    out_dir: Path
    train_seconds: float
    skipped_steps: int = 0  # updates the non-finite guard skipped


def train(
    config: RunConfig,
    *,
    resume: bool = True,
    after_step: Callable[[int], None] | None = None,
    quiet: bool = False,
) -> TrainResult:
    """Train a CausalLM (character-level by default) as `config` says; see the module docstring.

    `after_step(step)` is called after each step, at its boundary (tests use it to interrupt a run).
    A KeyboardInterrupt (Ctrl-C: at the next step boundary) saves a checkpoint at the last completed
    step before propagating.
    Under torchrun, only rank 0 returns a `final_eval` (the others return None).
    """
    context = init_distributed(config.train.device)
    try:
        return _train(config, resume, after_step, quiet, context)
    finally:
        finish_distributed(context)


def _train(config: RunConfig, resume: bool, after_step: Callable[[int], None] | None, quiet: bool,
           context: DistributedContext) -> TrainResult:
    schedule = config.train.schedule
    check_shardable(schedule.batch_size, context)
    device = resolve_device(config.train.device, context)
    check_precision(config.train.precision, device)
    quiet = quiet or not context.is_main
    out_dir = Path(config.out_dir)
    check_out_dir(out_dir)
    progress = Progress(schedule.steps, 0)
    say = (lambda message: None) if quiet else progress.message
    # What happens to the run's files and skipped updates is told even to a quiet run (rank 0).
    notice = (lambda message: progress.message(f"routeformer: {message}")) if context.is_main else say
    state = find_resume_state(out_dir, resume=resume, is_main=context.is_main, report=notice)

    corpus = load_data(config.data.corpus, config.data.path)
    # A resumed run keeps its saved tokeniser (its ids are the model's), whatever the file now holds.
    vocab = tokenizer_from_dict(state["vocab"]) if state else build_tokenizer(config.data.tokenizer,
                                                                                corpus.train)
    model_values = {**config.model.to_dict(), "vocab_size": len(vocab)}
    if config.model.positions == "learned":
        model_values["max_seq_len"] = max(config.model.max_seq_len, config.data.seq_len)
    density = config.data.meta_density
    if density > 0:
        model_values["meta_token_id"] = vocab.pause_id
    config.model = ModelConfig.from_dict(model_values)
    start = state["step"] if state else 0
    changes = config_changes(state["config"], config.to_dict()) if state else {}
    check_changes(changes, out_dir, start)
    train_ids, val_ids = tokenise_corpus(corpus, vocab)
    starts = (document_starts(train_ids, vocab.encode(DOCUMENT_SEPARATOR)) if config.data.pack_documents
              else None)

    settings = config.train
    torch.manual_seed(settings.seed)
    model = CausalLM(config.model).to(device)
    log = None  # rank 0 alone writes the run directory (opened below)

    def skipped(step: int, message: str) -> None:
        notice(f"warning: {message}")
        if log is not None:
            log.write({"step": step, "skipped": message})

    driver = Driver(model, schedule=schedule, seed=settings.seed, weight_decay=settings.weight_decay,
                    betas=(settings.beta1, settings.beta2), max_nonfinite=settings.max_nonfinite_steps,
                    device=device, on_skip=skipped, context=context,
                    scaler=gradient_scaler(settings.precision, device))
    if state:
        reseeded = driver.restore(state)
        if reseeded:
            notice(f"warning: {reseeded}")
        finished = recorded_final(out_dir, start) if start >= schedule.steps else None
        if finished is not None:  # nothing to train, nothing to write: no second "final" record
            notice(f"{str(out_dir)!r} already finished at step {start} (final validation bpc "
                   f"{finished.get('bpc', float('nan')):.4f}, recorded in metrics.jsonl); nothing to do "
                   "(raise train.steps to train on)")
            return TrainResult(start, finished if context.is_main else None, model, vocab, out_dir, 0.0,
                               driver.guard.skipped)

    if context.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        kept = write_config(out_dir, config, step=start)
        log = RunLog(out_dir, resume_step=start if state else None, logger=config.train.logger)
        if changes:  # the run's log says from which step which settings changed
            log.write({"step": start, "config_changes": {key: list(pair) for key, pair in changes.items()}})
        if kept is not None:
            notice(f"config.yaml differed from this run's config; the earlier one is kept as {kept.name}")
    progress = Progress(schedule.steps, start)
    parameters = sum(p.numel() for p in model.parameters())
    say(f"routeformer: {corpus.name}, {len(vocab)} symbols, {len(train_ids):,} training tokens; "
        f"model {parameters / 1e6:.2f}M parameters, attention {config.model.attention}"
        + (f"; {context.world_size} processes" if context.enabled else "")
        + (f"; precision {config.train.precision}" if config.train.precision != "fp32" else "")
        + (f"; resuming at step {start}" if state else ""))
    if changes:
        notice(f"resuming with changed settings (recorded in metrics.jsonl): {describe(changes)}")

    last_saved = start if state else None

    def checkpoint(step: int) -> None:
        nonlocal last_saved
        if step == last_saved:
            return
        rank_states = gather_rng_states(context, device)  # every rank takes part
        last_saved = step
        if not context.is_main:
            return
        saved = driver.capture(step, vocab=vocab.to_dict(), config=config.to_dict())
        if rank_states is not None:
            saved["rng"]["ranks"] = rank_states
        save_rotating(out_dir, saved, keep=settings.keep_checkpoints)

    meta_eval = {"meta_density": density, "meta_id": vocab.pause_id} if density > 0 else {}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        packed = {}
        if starts is not None:  # data.pack_documents: windows with document ids (data/documents.py)
            inputs, labels, documents = packed_random_batch(train_ids, starts, schedule.batch_size,
                                                            config.data.seq_len, driver.generator)
            packed["documents"] = local_shard(documents, context).to(device)
        else:
            inputs, labels = training_batch(train_ids, schedule.batch_size, config.data.seq_len, density,
                                            vocab, driver.generator)
        return local_shard(inputs, context).to(device), local_shard(labels, context).to(device), packed

    def after_update(result: StepResult) -> None:
        _after_update(result.step, settings, result.output, result.rate, result.grad_norm,
                      result.inputs.numel() * context.world_size, log, progress, quiet, context, device,
                      lambda: evaluate_lm(model, val_ids, seq_len=config.data.seq_len,
                                          batch_size=schedule.batch_size, max_tokens=settings.eval_tokens,
                                          **meta_eval))

    def periodic_checkpoint(result: StepResult) -> None:
        if result.step % settings.checkpoint_every == 0 or result.step == schedule.steps:
            with interrupts.critical():
                checkpoint(result.step)

    began = time.perf_counter()
    interrupts = DeferredInterrupts(agree=lambda flag: any_rank(flag, context)).install()
    position = driver.position
    try:
        # the logits only where a label is set, as task runs project them (the same weights as the
        # task run of this config where packed documents or meta-tokens leave labels unset)
        driver.train(next_batch,
                     lambda trained, inputs, labels, packed: trained(inputs, labels, logits_at_labels=True,
                                                                     **packed),
                     precision=settings.precision, on_update=after_update, on_step_end=periodic_checkpoint,
                     after_step=after_step, interrupts=interrupts)
    except KeyboardInterrupt as interrupt:
        if position.at_boundary and not isinstance(interrupt, InterruptedMidStep):
            with interrupts.critical(raise_after=False):
                checkpoint(position.step)
        message = interrupted_message(position.step, last_saved) if context.is_main else ""
        raise RunInterrupted(message) from None
    finally:
        interrupts.restore()
    step = position.step
    train_seconds = time.perf_counter() - began
    if not context.is_main:
        return TrainResult(step, None, model, vocab, out_dir, train_seconds, driver.guard.skipped)

    try:
        final = evaluate_lm(model, val_ids, seq_len=config.data.seq_len, batch_size=schedule.batch_size,
                            max_tokens=settings.final_eval_tokens, **meta_eval)
    except KeyboardInterrupt:
        raise RunInterrupted(f"interrupted in the final evaluation; the run is saved at step {step}: "
                             "run again to finish it") from None
    log.write({"step": step, "final": True, **{f"val_{k}": v for k, v in final.items()}})
    log.close()
    say(f"final validation ({final['tokens']:,} chars): loss {final['loss']:.4f} nats, "
        f"bits per character {final['bpc']:.4f}, perplexity {final['ppl']:.3f}"
        + (f"; {driver.guard.skipped} non-finite step(s) skipped" if driver.guard.skipped else ""))
    return TrainResult(step, final, model, vocab, out_dir, train_seconds, driver.guard.skipped)


def training_batch(
    ids: torch.Tensor, batch_size: int, seq_len: int, meta_density: float, vocab: Tokenizer,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM task's random windows (tasks/lm.py); with meta_density > 0, meta-tokens injected."""
    meta_id = vocab.pause_id if meta_density > 0 else None  # a tokenizer may have no meta-token
    return lm_windows(ids, batch_size, seq_len, generator, meta_density=meta_density, meta_id=meta_id)


def _after_update(
    step: int, settings, result, rate: float, grad_norm, tokens: int, log: RunLog | None,
    progress: Progress, quiet: bool, context: DistributedContext, device: torch.device,
    run_eval: Callable[[], dict[str, float]],
) -> None:
    record: dict[str, Any] | None = None
    if step % settings.log_every == 0 or step == settings.schedule.steps:
        # Every rank joins the reductions; only rank 0 (which has the log) writes.
        losses = mean_over_ranks(torch.stack([result.loss.detach(), result.aux_loss.detach()]), context)
        if log is None:
            return
        record = {
            "step": step,
            "loss": losses[0].item(),
            "aux_loss": losses[1].item(),
            "lr": rate,
            "grad_norm": float(grad_norm),
        }
        for key in settings.log_stats:
            values = [float(layer[key]) for layer in result.stats if key in layer]
            if values:
                record[f"attn_{key}"] = sum(values) / len(values)
    if log is None:
        return
    if step % settings.eval_every == 0:
        record = record or {"step": step}
        record.update({f"val_{k}": v for k, v in run_eval().items()})
    throughput = progress.tokens_per_second(tokens)
    if record is not None:
        record["tokens_per_s"] = throughput
        record["peak_mem_mib"] = peak_memory_mib(device)
        log.write(record)
        if not quiet:
            keys = ("loss", "val_bpc", "peak_mem_mib")
            progress.show(step, {key: record[key] for key in keys if key in record})
