"""The non-finite guard: a step whose loss or gradient is NaN/inf is skipped, not applied.

One bad batch (an overflow, a rare routing corner) should cost one step, not the run; a run that
keeps producing them has diverged and stops with a clear error after `limit` consecutive skips,
its last checkpoint (written before the trouble, and only ever with finite weights) intact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor


class TrainingDiverged(RuntimeError):
    """Training produced non-finite values it cannot recover from; the message is one line."""


def check_finite_weights(weights: Mapping[str, Tensor], *, where: str) -> None:
    """Raise TrainingDiverged naming the first floating tensor of `weights` that holds NaN/inf."""
    for name, tensor in weights.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise TrainingDiverged(f"refusing to write {where}: weight {name!r} holds non-finite values")


class NonFiniteGuard:
    """Decides per step whether the update may be applied (see the module docstring).

    `warn(step, message)` hears about every skipped step; `all_ranks(flag)` makes the decision the same on
    every process under DistributedDataParallel (a rank whose loss alone is NaN skips everywhere).
    """

    def __init__(self, limit: int, warn: Callable[[int, str], None] | None = None,
                 all_ranks: Callable[[Tensor], Tensor] | None = None) -> None:
        self.limit = limit
        self.warn = warn or (lambda step, message: None)
        self.all_ranks = all_ranks or (lambda flag: flag)
        self.consecutive = 0
        self.skipped = 0

    def allows(self, step: int, loss: Tensor, grad_norm: Tensor | float) -> bool:
        """True when `loss` and `grad_norm` are finite; otherwise count the skip, warn, and raise
        TrainingDiverged once `limit` steps in a row were skipped."""
        grad_norm = torch.as_tensor(grad_norm, device=loss.device)
        finite = torch.isfinite(loss.detach().float()) & torch.isfinite(grad_norm.float())
        if bool(self.all_ranks(finite.to(torch.float32)) == 1):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        values = f"loss {loss.item():.4g}, gradient norm {float(grad_norm):.4g}"
        if self.consecutive >= self.limit:
            raise TrainingDiverged(
                f"training diverged: {self.consecutive} consecutive steps with a non-finite loss or "
                f"gradient (step {step}: {values}); try a lower train.lr or a train.grad_clip (any "
                "checkpoint of the run predates this and holds finite weights)")
        self.warn(step, f"step {step}: non-finite {values}; update skipped "
                  f"({self.consecutive} in a row, the run stops at {self.limit})")
        return False
