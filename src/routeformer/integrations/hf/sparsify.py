"""A pretrained dense transformers model converted to routed attention: the conversion of
train/sparsify.py (DeepSeek-V3.2's two stages for DSA) on a GPT-2 or Llama-family model.

    from routeformer.integrations.hf import sparsify_pretrained
    model, record = sparsify_pretrained(model, "topk", batches, steps=200, topk=64)
    model.save_pretrained("out")   # AutoModelForCausalLM.from_pretrained("out") reloads it routed

`patch_attention` swaps every attention module for `mechanism`, holding the model's Q/K/V/O
weights. Stage 1 (`steps`): every parameter but the routing parameters (`router.*` of each swapped
layer) frozen; the router trains by topk's KL to the dense attention over every eligible key
(`routing_learning="distill"`, `distill_dense_steps=steps`); the loss is the summed aux loss alone.
Stage 2 (`sparse_steps`, optional): every parameter trains on the causal-LM loss (labels = the
input ids, padding ignored) plus the aux loss (the KL over the routed selection). Each stage runs
the one training loop (train/steps.py: AdamW without weight decay, gradients clipped to norm 1, a
non-finite step skipped) with a linear warm-up over the first tenth of the stage and a cosine decay
to a tenth of its rate.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

from torch import Tensor, nn

from routeformer.integrations.hf.patch import patch_attention, routeformer_aux_loss, routeformer_layers
from routeformer.train.guard import NonFiniteGuard
from routeformer.train.optim import build_optimizer
from routeformer.train.schedule import Schedule
from routeformer.train.sparsify import check_mechanism, stage_options
from routeformer.train.steps import StepState, run_steps
from routeformer.train.task_loop import MAX_NONFINITE_STEPS

ROUTING_PREFIX = "router."  # the routing parameters of a swapped topk layer
HF_CONVERTIBLE = ("topk",)


def routing_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The routing parameters of a patched model's swapped layers, by name."""
    found = {}
    for name, module in model.named_modules():
        if module in routeformer_layers(model):
            for inner, parameter in module.layer.named_parameters():
                if inner.startswith(ROUTING_PREFIX):
                    found[f"{name}.layer.{inner}"] = parameter
    return found


def _batches(batches: Iterable[Any], steps: int) -> Iterator[tuple[Tensor, Tensor | None]]:
    """`steps` (input_ids, attention_mask or None) pairs from `batches` (tensors of token ids, or
    dicts with "input_ids" and optionally "attention_mask"); ValueError when it runs out."""
    iterator = iter(batches)
    for step in range(steps):
        try:
            batch = next(iterator)
        except StopIteration:
            raise ValueError(f"batches: ran out after {step} of the {steps} steps asked") from None
        if isinstance(batch, Tensor):
            yield batch, None
        elif isinstance(batch, dict) and "input_ids" in batch:
            yield batch["input_ids"], batch.get("attention_mask")
        else:
            raise TypeError(f"batches: each batch must be a LongTensor of token ids or a dict with "
                            f"'input_ids'; got {type(batch).__name__}")


def _train(model: nn.Module, batches: Iterator[tuple[Tensor, Tensor | None]], steps: int, lr: float,
           loss_of: Callable[[Tensor, Tensor | None], Tensor]) -> list[float]:
    """`steps` steps of the one training loop (train/steps.py) on the parameters that require a
    gradient, the loss `loss_of(input_ids, attention_mask)` of each of `batches`; the loss per step."""
    schedule = Schedule(steps=steps, batch_size=0,  # batch_size: the batches' own, not drawn here
                        lr=lr, warmup_steps=max(1, round(0.1 * steps)))
    optimizer = build_optimizer(model, lr=lr, weight_decay=0.0)
    guard = NonFiniteGuard(MAX_NONFINITE_STEPS, warn=lambda step, message: warnings.warn(
        f"sparsify_pretrained: {message}", RuntimeWarning, stacklevel=2))
    losses: list[float] = []

    def next_batch() -> tuple[Tensor, None, dict[str, Tensor | None]]:
        input_ids, attention_mask = next(batches)
        return input_ids, None, {"attention_mask": attention_mask}

    def forward(input_ids: Tensor, labels: None, extra: dict[str, Tensor | None]) -> SimpleNamespace:
        return SimpleNamespace(total_loss=loss_of(input_ids, extra["attention_mask"]))

    run_steps(model, optimizer, schedule, guard, StepState(0), next_batch, forward,
              on_step_end=lambda result: losses.append(float(result.output.total_loss.detach())))
    return losses


def sparsify_pretrained(
    model: nn.Module, mechanism: str, batches: Iterable[Any], *, steps: int, sparse_steps: int = 0,
    lr: float = 1e-3, sparse_lr: float = 1e-4, **options: Any,
) -> tuple[nn.Module, dict[str, Any]]:
    """(the patched model in eval mode, record): `model` (a dense GPT-2 or Llama-family transformers
    model, patched in place) converted to `mechanism` with layer `options` by the two stages of the
    module docstring, reading `steps + sparse_steps` batches from `batches`.

    Args:
        model: a transformers causal LM with dense attention (patch_attention's families).
        mechanism: a mechanism that converts a transformers model (`HF_CONVERTIBLE`: topk, whose
            router trains by the dense-attention KL through the patched attention).
        batches: LongTensors [B, T] of token ids, or dicts with "input_ids" and "attention_mask".
        steps: stage-1 steps (>= 1); sparse_steps: stage-2 steps (>= 0).
        lr, sparse_lr: each stage's peak learning rate.

    Returns the record {"mechanism", "options", "steps", "sparse_steps", "tokens", "stage1_kl",
    "stage2_loss"} (the losses per step). Raises ValueError for a mechanism that does not convert,
    options the conversion sets itself, steps < 1, or too few batches; patch_attention's errors for
    a model it cannot patch."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    if not isinstance(sparse_steps, int) or sparse_steps < 0:
        raise ValueError(f"sparse_steps must be an integer >= 0; got {sparse_steps!r}")
    check_mechanism(mechanism, HF_CONVERTIBLE)
    layer_options = stage_options(mechanism, options, steps)
    patch_attention(model, mechanism, **layer_options)
    routing = routing_parameters(model)
    if not routing:
        raise ValueError(f"a patched {mechanism!r} model has no routing parameters to train")
    stream = _batches(batches, steps + sparse_steps)
    tokens = 0

    def warm_up(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        nonlocal tokens
        tokens += input_ids.numel()
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return routeformer_aux_loss(model)

    def sparse(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        nonlocal tokens
        tokens += input_ids.numel()
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        return output.loss + routeformer_aux_loss(model)

    trainable = {id(parameter) for parameter in routing.values()}
    kept = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in trainable)
    try:
        kl = _train(model, stream, steps, lr, warm_up)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(kept.get(name, True))
        stage2 = _train(model, stream, sparse_steps, sparse_lr, sparse) if sparse_steps else []
    finally:
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(kept.get(name, True))
    record = {"mechanism": mechanism, "options": layer_options, "steps": steps, "sparse_steps": sparse_steps,
              "tokens": tokens, "stage1_kl": kl, "stage2_loss": stage2}
    return model.eval(), record
