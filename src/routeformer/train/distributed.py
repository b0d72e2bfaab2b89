"""Multi-process training under `torchrun` (DistributedDataParallel; gloo on CPU, nccl on GPU).

    torchrun --standalone --nproc_per_node 2 -m routeformer.cli train --steps 600

Sharding: every rank draws the same global batch of `train.batch_size` windows from the same
seeded generator and keeps its own contiguous slice. The data stream is therefore the one a
single process would see, whatever the world size: a run resumes from its checkpoint on any
number of processes, and 2 processes match 1 process with the same global batch up to the order
of floating-point reductions. Rank 0 alone evaluates, logs and writes checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialised_here: bool = False  # this process created the process group (and destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> DistributedContext:
    """Join the process group that torchrun describes in the environment (WORLD_SIZE, RANK, ...);
    a plain single process gets the trivial context."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistributedContext()
    import torch.distributed as dist

    initialised_here = not dist.is_initialized()
    if initialised_here:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return DistributedContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                              initialised_here)


def resolve_device(device: str, context: DistributedContext) -> torch.device:
    """train.device: "cpu", "cuda" (cuda:LOCAL_RANK under torchrun) or "auto" (cuda when available)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device='cuda' but no CUDA device is available; use 'cpu' or 'auto'")
        return torch.device("cuda", context.local_rank)
    return torch.device(device)


def check_shardable(batch_size: int, context: DistributedContext) -> None:
    if batch_size % context.world_size:
        raise ValueError(f"train.batch_size ({batch_size}) is the global batch and must be divisible by the "
                         f"number of processes ({context.world_size})")


def local_shard(batch: Tensor, context: DistributedContext) -> Tensor:
    """This rank's contiguous slice of the global batch (dimension 0)."""
    size = batch.shape[0] // context.world_size
    return batch[context.rank * size:(context.rank + 1) * size]


def mean_over_ranks(value: Tensor, context: DistributedContext) -> Tensor:
    """The mean of a scalar over the ranks (for logging); the value itself on one process."""
    if not context.enabled:
        return value
    import torch.distributed as dist

    reduced = value.detach().clone()
    dist.all_reduce(reduced)
    return reduced / context.world_size


def finish_distributed(context: DistributedContext) -> None:
    if context.initialised_here:
        import torch.distributed as dist

        dist.destroy_process_group()
