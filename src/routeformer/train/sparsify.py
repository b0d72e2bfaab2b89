"""From a trained dense model to a routed one: DeepSeek-V3.2's two-stage conversion of DSA.

`sparsify(model, mechanism, options=...)` builds the same model (same ModelConfig, every layer
`mechanism` with `options`) holding the dense model's weights: embeddings, MLPs, norms and every
layer's Q/K/V/O (`qkv_proj`, `out_proj`, shared by every attention layer under the same names). The
parameters the dense model has not are the routing parameters (topk: `router.*`), freshly
initialised. `convert_on_task` then trains them on a task's batches, through the task loop
(train/task_loop.py, AdamW, warm-up + cosine):

- stage 1, dense warm-up (`steps`): every dense parameter frozen (requires_grad False), only the
  routing parameters train, by the layer's own KL to the dense attention over every eligible key
  (topk with `routing_learning="distill"`, `distill_dense_steps=steps`, on `distill_queries`
  sampled query rows); the loss is the summed aux loss alone.
- stage 2, sparse (`sparse_steps`, optional): every parameter trains on the task loss plus the
  aux loss (the KL over the routed selection, the router's input detached).

Which mechanisms convert: `topk` (its router has a dense-attention KL to learn from). Others are
refused (ValueError, `CONVERTIBLE` names the allowed ones). The source's layers must all be `full`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import TaskHistory, TaskTrainConfig, train_task

CONVERTIBLE = ("topk",)
SOURCE_MECHANISMS = ("full",)
# Default stage-1 steps: this share of the source's training steps (at least MIN_STEPS).
WARMUP_SHARE = 0.05
MIN_STEPS = 20
STAGE1_LR = 1e-3  # DSA's warm-up learning rate
# Default stage-2 learning rate: this share of the source's peak rate (where its cosine ended).
STAGE2_LR_SHARE = 0.1
REFUSED = {
    "mita": "its landmarks and expert routing have no dense-attention KL of their own to train "
            "by, and this conversion has no other stage-1 objective",
    "meta": "its controller and experts have no dense-attention KL of their own to train by, and "
            "this conversion has no other stage-1 objective",
}


def _layer_mechanisms(config: Any) -> list[str]:
    attention = config.attention
    return [attention] * config.depth if isinstance(attention, str) else list(attention)


def check_mechanism(mechanism: str) -> None:
    """ValueError unless `mechanism` converts (see `CONVERTIBLE`), naming why it does not."""
    from routeformer.attention import list_attentions

    if mechanism not in list_attentions():
        raise ValueError(f"mechanism {mechanism!r} is not registered; it converts to: {list(CONVERTIBLE)}")
    if mechanism not in CONVERTIBLE:
        reason = REFUSED.get(mechanism, "it has no routing parameters trained by a KL to dense attention")
        raise ValueError(f"mechanism {mechanism!r} does not convert from a dense model: {reason}; "
                         f"mechanisms that convert: {list(CONVERTIBLE)}")


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
    dense_state = model.state_dict()
    routed_state = routed.state_dict()
    unexpected = sorted(set(dense_state) - set(routed_state))
    if unexpected:
        raise ValueError(f"the dense parameters {unexpected} have no place in a {mechanism!r} layer")
    for name, tensor in dense_state.items():
        if routed_state[name].shape != tensor.shape:
            raise ValueError(f"parameter {name!r} is {tuple(tensor.shape)} in the dense model and "
                             f"{tuple(routed_state[name].shape)} in the {mechanism!r} one")
    routed.load_state_dict(dense_state, strict=False)
    dense_names = set(dense_state)
    routed.new_parameters = [name for name, _ in routed.named_parameters() if name not in dense_names]
    return routed.train()


def stage_options(mechanism: str, options: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    """The layer options the conversion builds with: `options` plus, for topk, the DSA warm-up
    (`routing_learning="distill"`, `distill_dense_steps=steps`). ValueError when `options` asks
    for another routing_learning."""
    chosen = dict(options or {})
    if mechanism == "topk":
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


def default_steps(source_steps: int) -> int:
    """Stage-1 steps when none are given: WARMUP_SHARE of the source's training steps, at least
    MIN_STEPS."""
    return max(MIN_STEPS, round(WARMUP_SHARE * source_steps))


def convert_on_task(
    dense: nn.Module, task: Any, mechanism: str, *, options: dict[str, Any] | None = None, steps: int,
    sparse_steps: int = 0, batch_size: int = 32, lr: float = STAGE1_LR, sparse_lr: float = 3e-4,
    seed: int = 0, evals: int = 2, validation_sequences: int = 256,
    log: Callable[[str], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """(routed model in eval mode, record) from the dense `dense` model trained on `task`.

    Stage 1 runs `steps` (>= 1) steps at peak rate `lr`, stage 2 `sparse_steps` (>= 0) at
    `sparse_lr`, each on `task.batch(batch_size, generator, "train")` with a generator seeded by
    `seed` (torch's too): the result is deterministic given the seed. Each stage is evaluated
    `evals` times on `validation_sequences` validation sequences. The record holds each stage's
    history (`train_loss`, `aux_loss` = the KL, and the task metric at each evaluation), steps and
    tokens, and `new_parameters`."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    if not isinstance(sparse_steps, int) or sparse_steps < 0:
        raise ValueError(f"sparse_steps must be an integer >= 0; got {sparse_steps!r}")
    from routeformer.train.on_task import evaluate_on_task

    layer_options = stage_options(mechanism, options, steps)
    torch.manual_seed(seed)
    model = sparsify(dense, mechanism, options=layer_options)
    new = set(model.new_parameters)
    if not new:
        raise ValueError(f"a {mechanism!r} model has no routing parameters to train")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in new)

    def batches(size: int, generator: torch.Generator):
        return task.batch(size, generator, "train")

    def evaluate(m: nn.Module) -> dict[str, Any]:
        return evaluate_on_task(m, task, "validation", validation_sequences)

    def warm_up(m: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
        output = m(inputs, labels, mask=task.mask(inputs), logits_at_labels=True)
        return dataclasses.replace(output, loss=output.loss.detach())  # the KL alone trains

    def sparse(m: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
        return m(inputs, labels, mask=task.mask(inputs), logits_at_labels=True)

    histories: list[TaskHistory] = []
    stages = [("dense_warmup", steps, lr, warm_up)]
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
