"""What every attention layer returns (the contract is attention/base.py's); its own module so
that helpers building outputs (attention/documents.py) need not import the base class's module."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from routeformer.ops.backends import TORCH, joined


@dataclass
class AttentionOutput:
    """What every attention layer returns: the output [B, T, D], its auxiliary loss (already
    weighted) and detached diagnostics (`stats["flops"]`: the attention FLOPs executed)."""

    out: Tensor  # [B, T, D]
    aux_loss: Tensor  # scalar, already weighted; 0 where the mechanism has none
    stats: dict[str, Tensor] = field(default_factory=dict)
    # op -> the backend that ran it ("triton", "native", "torch"; ops/backends.py), filled by the
    # contract's wrapper. None inside a torch.compile'd call: compiled code runs no Python per
    # call, so nothing is observed (the graph keeps what tracing chose). Not in `stats`, which
    # holds tensors only.
    backends: dict[str, str] | None = None

    @property
    def backend(self) -> str:
        """The backends this call ran, as one name: "torch" (also for a pure PyTorch mechanism),
        "native", "triton", or a mix such as "native+torch"; "unobserved" under torch.compile."""
        if self.backends is None:
            return "unobserved"
        return joined(*self.backends.values()) or TORCH
