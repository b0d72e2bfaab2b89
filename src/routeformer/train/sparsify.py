"""From a trained dense model to a routed one: DeepSeek-V3.2's two-stage conversion of DSA.

`sparsify(model, mechanism, options=...)` builds the same model (same ModelConfig, every layer
`mechanism` with `options`) holding the dense model's weights: embeddings, MLPs, norms and every
layer's Q/K/V/O (`qkv_proj`, `out_proj`; `meta` copies them into each of its experts,
`expert_qkv.i` / `expert_out.i`). The parameters the dense model has not are the routing
parameters (topk: `router.*`; meta: its controller `router.*`), freshly initialised.
`convert_on_task` then trains them on a task's batches, through the task loop
(train/task_loop.py, AdamW, warm-up + cosine):

- stage 1, dense warm-up (`steps`): every dense parameter frozen (requires_grad False), only the
  routing parameters train. topk: by its own KL to the dense attention over every eligible key
  (`routing_learning="distill"`, `distill_dense_steps=steps`, on `distill_queries` sampled query
  rows); the loss is the summed aux loss alone. meta: its controller has no dense-attention KL, so
  it learns which expert each token needs from the task loss plus its own aux loss (the ELBO
  term), the experts frozen at the dense weights.
- stage 2, sparse (`sparse_steps`, optional): every parameter trains on the task loss plus the
  aux loss (topk: the KL over the routed selection, the router's input detached).

`mita` has no parameters of its own (its landmarks and expert routing are computed from the
copied Q/K/V), so it converts with `steps=0`: the dense weights run under MiTA's routing at once,
and stage 2 fine-tunes them (MiTA's Table 3 setting). Which mechanisms convert: `CONVERTIBLE`;
others are refused (ValueError). The source's layers must all be `full`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import TaskHistory, TaskTrainConfig, train_task

CONVERTIBLE = ("topk", "meta", "mita")
# Mechanisms whose router learns in stage 1 from its own KL to dense attention (the task loss is
# not trained on); the others' routing parameters learn from the task loss and their aux loss.
KL_WARMUP = ("topk",)
SOURCE_MECHANISMS = ("full",)
# Mechanisms with no parameters of their own: stage 1 has nothing to train (steps=0).
WITHOUT_ROUTING_PARAMETERS = ("mita",)
# Default stage-1 steps: this share of the source's training steps (at least MIN_STEPS).
WARMUP_SHARE = 0.05
MIN_STEPS = 20
STAGE1_LR = 1e-3  # DSA's warm-up learning rate
# Default stage-2 learning rate: this share of the source's peak rate (where its cosine ended).
STAGE2_LR_SHARE = 0.1
# Where a dense parameter goes in a routed layer whose names differ: meta's three experts each
# start from the dense projections.
COPIED_AS = {"meta": {"qkv_proj.weight": r"expert_qkv\.\d+\.weight",
                      "out_proj.weight": r"expert_out\.\d+\.weight"}}


def _layer_mechanisms(config: Any) -> list[str]:
    attention = config.attention
    return [attention] * config.depth if isinstance(attention, str) else list(attention)


def check_mechanism(mechanism: str, convertible: tuple[str, ...] = CONVERTIBLE) -> None:
    """ValueError unless `mechanism` is one of `convertible` (default `CONVERTIBLE`), naming why
    it does not convert."""
    from routeformer.attention import list_attentions

    if mechanism not in list_attentions():
        raise ValueError(f"mechanism {mechanism!r} is not registered; it converts to: {list(convertible)}")
    if mechanism not in convertible:
        reason = "it has no dense attention to start from or no routing of its own to train"
        raise ValueError(f"mechanism {mechanism!r} does not convert from a dense model: {reason}; "
                         f"mechanisms that convert: {list(convertible)}")


def check_source(model: nn.Module) -> None:
    """ValueError unless every layer of `model` is dense attention (`SOURCE_MECHANISMS`), naming the
    first layer that is not and its mechanism."""
    for index, name in enumerate(_layer_mechanisms(model.config)):
        if name not in SOURCE_MECHANISMS:
            raise ValueError(f"source layer {index} runs {name!r}, not dense attention "
                             f"{list(SOURCE_MECHANISMS)}: there is no dense attention to copy")


def sparsify(model: nn.Module, mechanism: str, *, options: dict[str, Any] | None = None) -> nn.Module:
    """A copy of `model` (a TokenPredictor or CausalLM whose layers are all `full`) with every layer
    running `mechanism` with `options`, holding the dense model's weights.

    The copy is of the model's own class, in train mode; its `new_parameters` attribute lists the
    names of the parameters the dense model has not (the routing parameters). Raises ValueError for
    a source layer that is not dense, a mechanism that does not convert, bad layer options (the
    layer's own message), or a shared parameter whose shape differs."""
    check_source(model)
    check_mechanism(mechanism)
    config = dataclasses.replace(model.config, attention=mechanism,
                                 attention_options={mechanism: dict(options)} if options else {})
    routed = type(model)(config)
    routed_state = routed.state_dict()
    copied = {}
    for name, tensor in model.state_dict().items():
        targets = _targets(mechanism, name, routed_state)
        if not targets:
            raise ValueError(f"the dense parameter {name!r} has no place in a {mechanism!r} layer")
        for target in targets:
            if routed_state[target].shape != tensor.shape:
                raise ValueError(f"parameter {name!r} is {tuple(tensor.shape)} in the dense model and "
                                 f"{tuple(routed_state[target].shape)} as {target!r} in the "
                                 f"{mechanism!r} one")
            copied[target] = tensor
    routed.load_state_dict(copied, strict=False)
    routed.new_parameters = [name for name, _ in routed.named_parameters() if name not in copied]
    return routed.train()


def _targets(mechanism: str, name: str, routed_state: dict[str, torch.Tensor]) -> list[str]:
    """The routed model's entries that dense entry `name` fills: the same name, or for a mechanism
    in COPIED_AS every indexed counterpart (meta: one per expert)."""
    if name in routed_state:
        return [name]
    for suffix, pattern in COPIED_AS.get(mechanism, {}).items():
        if name.endswith(suffix):
            expected = re.escape(name[: -len(suffix)]) + pattern
            return [entry for entry in routed_state if re.fullmatch(expected, entry)]
    return []


def stage_options(mechanism: str, options: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    """The layer options the conversion builds with: `options` plus, for topk, the DSA warm-up
    (`routing_learning="distill"`, `distill_dense_steps=steps`). ValueError when `options` asks
    for another routing_learning."""
    chosen = dict(options or {})
    if mechanism in KL_WARMUP:
        learning = chosen.setdefault("routing_learning", "distill")
        if learning != "distill":
            raise ValueError(f"option routing_learning={learning!r}: the conversion trains topk's router "
                             "by the dense-attention KL, routing_learning='distill'")
        if "distill_dense_steps" in chosen:
            raise ValueError("option distill_dense_steps: set by the conversion (its --steps)")
        if steps:
            chosen["distill_dense_steps"] = steps
    return chosen


def run_tokens(config: dict[str, Any], seq_len: int) -> int | None:
    """The training tokens of a task run from its config (config.json / the checkpoint's `run`):
    every stage's steps x batch x length (a curriculum stage's own seq_len, else `seq_len`, the
    task's); None when the config names no schedule."""
    setup = config.get("setup", {})
    if "batch_size" not in setup.get("schedule", {}):
        return None
    stages = [*setup.get("curriculum", ()), {"options": {}, "schedule": setup["schedule"]}]
    return sum(int(stage["schedule"]["steps"]) * int(stage["schedule"]["batch_size"])
               * int(stage["options"].get("seq_len", seq_len)) for stage in stages)


def default_steps(source_steps: int, mechanism: str = "topk") -> int:
    """Stage-1 steps when none are given: WARMUP_SHARE of the source's training steps, at least
    MIN_STEPS; 0 for a mechanism WITHOUT_ROUTING_PARAMETERS."""
    if mechanism in WITHOUT_ROUTING_PARAMETERS:
        return 0
    return max(MIN_STEPS, round(WARMUP_SHARE * source_steps))


def convert_on_task(
    dense: nn.Module, task: Any, mechanism: str, *, options: dict[str, Any] | None = None, steps: int,
    sparse_steps: int = 0, batch_size: int = 32, lr: float = STAGE1_LR, sparse_lr: float = 3e-4,
    seed: int = 0, evals: int = 2, validation_sequences: int = 256,
    log: Callable[[str], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """(routed model in eval mode, record) from the dense `dense` model trained on `task`.

    Stage 1 runs `steps` steps at peak rate `lr` (>= 1 where the routed model has parameters of
    its own, 0 for mita, which has none), stage 2 `sparse_steps` (>= 0; >= 1 for mita) at
    `sparse_lr`, each on `task.batch(batch_size, generator, "train")` with a generator seeded by
    `seed` (torch's too): the result is deterministic given the seed. Each stage is evaluated
    `evals` times on `validation_sequences` validation sequences. The record holds each stage's
    history (`train_loss`, `aux_loss` = topk's KL or the layer's own aux loss, and the task metric
    at each evaluation), steps and tokens, and `new_parameters`. ValueError for steps or
    sparse_steps the mechanism cannot take, and for what `sparsify` refuses."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0; got {steps!r}")
    if not isinstance(sparse_steps, int) or sparse_steps < 0:
        raise ValueError(f"sparse_steps must be an integer >= 0; got {sparse_steps!r}")
    from routeformer.train.on_task import evaluate_on_task

    layer_options = stage_options(mechanism, options, steps)
    torch.manual_seed(seed)
    model = sparsify(dense, mechanism, options=layer_options)
    new = set(model.new_parameters)
    if new and steps < 1:
        raise ValueError(f"steps must be >= 1: a {mechanism!r} model has routing parameters to warm up "
                         f"({sorted(new)[0]!r}, ...); got {steps!r}")
    if not new and steps:
        raise ValueError(f"steps must be 0: a {mechanism!r} model has no parameters of its own to warm up "
                         f"(only sparse_steps train it); got {steps!r}")
    if not new and not sparse_steps:
        raise ValueError(f"sparse_steps must be >= 1: a {mechanism!r} model has nothing to train in stage 1")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in new)

    def batches(size: int, generator: torch.Generator):
        return task.batch(size, generator, "train")

    def evaluate(m: nn.Module) -> dict[str, Any]:
        return evaluate_on_task(m, task, "validation", validation_sequences)

    def warm_up(m: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
        output = m(inputs, labels, mask=task.mask(inputs), logits_at_labels=True)
        if mechanism not in KL_WARMUP:
            return output  # no dense-attention KL: the task loss and the aux loss train the router
        return dataclasses.replace(output, loss=output.loss.detach())  # the KL alone trains

    def sparse(m: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
        return m(inputs, labels, mask=task.mask(inputs), logits_at_labels=True)

    histories: list[TaskHistory] = []
    stages = [("dense_warmup", steps, lr, warm_up)] if steps else []
    if sparse_steps:
        stages.append(("sparse", sparse_steps, sparse_lr, sparse))
    record: dict[str, Any] = {"mechanism": mechanism, "options": layer_options,
                              "new_parameters": sorted(new), "seed": seed, "stages": {}}
    for index, (name, count, rate, forward) in enumerate(stages):
        if name == "sparse":
            for parameter in model.parameters():
                parameter.requires_grad_(True)
        schedule = Schedule(steps=count, batch_size=batch_size, lr=rate,
                            warmup_steps=max(1, min(count, round(0.1 * count))))
        config = TaskTrainConfig(schedule=schedule, weight_decay=0.0 if name == "dense_warmup" else 0.1,
                                 eval_every=max(1, count // max(1, evals)), seed=seed + index)
        history = train_task(model, batches, evaluate, config, forward=forward,
                             log=(lambda line, name=name: log(f"{name}: {line}")) if log else None)
        histories.append(history)
        record["stages"][name] = {"steps": count, "lr": rate, "batch_size": batch_size,
                                  "tokens": count * batch_size * task.seq_len,
                                  "history": history.evals, "train_seconds": history.train_seconds}
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    record["tokens"] = sum(stage["tokens"] for stage in record["stages"].values())
    return model.eval(), record
