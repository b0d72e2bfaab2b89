"""Multi-process training under `torchrun` (DistributedDataParallel; gloo on CPU, nccl on GPU).

    torchrun --standalone --nproc_per_node 2 -m routeformer.cli train --steps 600

Sharding: every rank draws the same global batch of `train.batch_size` windows from the same
seeded generator and keeps its own contiguous slice. The data stream is therefore the one a
single process would see, whatever the world size: a run resumes from its checkpoint on any
number of processes, and 2 processes match 1 process with the same global batch up to the order
of floating-point reductions. Rank 0 alone evaluates, logs and writes checkpoints.

Randomness: the ranks share the batch generator but each draws its own dropout and routing samples
from its own torch RNG (rank r > 0 seeded with `seed + r` at a fresh start). A checkpoint carries
every rank's RNG state (`gather_rng_states`, collected over a gloo group with a 60 s timeout), so a
run resumed on the same number of processes continues bit-identically to one never interrupted.
A rank the checkpoint has no state for (more processes than before, or a checkpoint whose
interrupted ranks could not be reached) is reseeded, and the run says so.

Waits: `$ROUTEFORMER_DIST_TIMEOUT_S` bounds the rendezvous and every collective (`collective_timeout`;
unset: PyTorch's default, 30 min for gloo); a rank that waits longer fails with an error naming the
operation instead of waiting on a rank that died or took another path. The tests set 60 s.

DistributedDataParallel searches for parameters without gradient after every backward only when
the model needs it (`needs_unused_parameter_search`): that search costs a graph traversal per
step, and the mechanisms that always use every parameter skip it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

RNG_GATHER_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialised_here: bool = False  # this process created the process group (and destroys it)
    cpu_group: Any = None  # a gloo group for gathering RNG states (CPU tensors) with a short timeout

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
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=collective_timeout())
    cpu_group = dist.new_group(backend="gloo", timeout=RNG_GATHER_TIMEOUT)
    return DistributedContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                              initialised_here, cpu_group)


def collective_timeout() -> datetime.timedelta | None:
    """How long a rank waits for the others (rendezvous and every collective) before it fails with
    an error naming the operation: `$ROUTEFORMER_DIST_TIMEOUT_S` seconds, else PyTorch's default
    (None; 30 min for gloo). Rank 0 evaluates alone while the others wait at their next collective,
    so a run whose evaluations are long needs the default; tests set a short one so that a
    mismatched collective fails instead of hanging."""
    value = os.environ.get("ROUTEFORMER_DIST_TIMEOUT_S")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"ROUTEFORMER_DIST_TIMEOUT_S must be a positive number of seconds; got {value!r}")
    return datetime.timedelta(seconds=seconds)


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


def any_rank(flag: bool, context: DistributedContext) -> bool:
    """Whether `flag` is set on any rank (every rank must call it); the flag itself on one process."""
    if not context.enabled:
        return flag
    import torch.distributed as dist

    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=context.cpu_group)
    return bool(value.item() > 0)


def needs_unused_parameter_search(mechanisms: Iterable[str]) -> bool:
    """Whether DDP must look for parameters left without gradient (`find_unused_parameters`): true
    unless every layer's mechanism declares `every_parameter_used` where it is registered (a name
    nobody registered gets the search: correct for all, slower)."""
    from routeformer.attention import list_attentions
    from routeformer.attention.registry import attention_class

    registered = set(list_attentions())
    return not all(name in registered and attention_class(name).every_parameter_used for name in mechanisms)


def rank_rng_state(device: torch.device) -> Tensor:
    """This process's torch RNG state (CPU, then CUDA's when training on CUDA) as one byte tensor."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def set_rank_rng_state(state: Tensor, device: torch.device) -> None:
    cpu_size = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu_size].clone())
    if device.type == "cuda" and state.numel() > cpu_size:
        torch.cuda.set_rng_state(state[cpu_size:].clone(), device)


def gather_rng_states(context: DistributedContext, device: torch.device) -> list[Tensor] | None:
    """Every rank's `rank_rng_state`, in rank order (every rank must call it; all get the list).
    None when a rank does not answer within RNG_GATHER_TIMEOUT (an interrupted run whose ranks
    stopped at different places)."""
    own = rank_rng_state(device)
    if not context.enabled:
        return [own]
    import torch.distributed as dist

    states = [torch.empty_like(own) for _ in range(context.world_size)]
    try:
        dist.all_gather(states, own, group=context.cpu_group)
    except RuntimeError:
        return None
    return states


def restore_rank_rng(rng: dict[str, Any], context: DistributedContext, device: torch.device,
                     seed: int, step: int) -> str | None:
    """Set this rank's torch RNG from a checkpoint's `rng`; a message when it had to be reseeded
    (no saved state for this rank), else None."""
    states = rng.get("ranks") or [rng["torch"]]
    if context.rank < len(states):
        set_rank_rng_state(states[context.rank], device)
        return None
    torch.manual_seed(seed + context.rank + 1000 * step)
    return (f"the checkpoint holds RNG states for {len(states)} process(es); rank {context.rank} was "
            "reseeded, so its dropout and routing samples differ from an uninterrupted run")


def finish_distributed(context: DistributedContext) -> None:
    """Leave the process group `init_distributed` joined: the ranks first meet at a barrier on the
    gloo group, so that no rank tears gloo down while another still uses its connections; a rank
    that is gone, or stuck elsewhere past RNG_GATHER_TIMEOUT, ends the wait and the group is
    destroyed all the same."""
    if context.initialised_here:
        import torch.distributed as dist

        with contextlib.suppress(RuntimeError):  # a rank that left or failed: destroy all the same
            dist.barrier(group=context.cpu_group)
        dist.destroy_process_group()
