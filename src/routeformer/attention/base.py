"""The contract every routeformer attention layer keeps (see docs/design.md).

    layer(x [B, T, D], *, mask=None, positions=None) -> AttentionOutput(out [B, T, D], aux_loss, stats)
    layer(x, documents=ids)  # packed sequences: ids [B, T], no attention across documents

`mask` is a bool key-padding mask [B, T] (True = real token); `positions` are long [B, T]
(default arange), used by rotary embeddings and position-aware routers. `causal` is fixed at
construction. `stats` holds detached diagnostics; `stats["flops"]` is the attention FLOPs the
layer executed for this call; `backends` / `backend` name the kernels that ran (ops/backends.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.attention.output import AttentionOutput
from routeformer.ops._checks import check_positive
from routeformer.ops.backends import profile_range, recording
from routeformer.ops.documents import check_documents, document_starts
from routeformer.ops.grouped_heads import check_kv_heads
from routeformer.ops.rotary import apply_rotary, rotary_angles


def split_qkv(qkv: Tensor) -> tuple[Tensor, ...]:
    """[B, T, n, H, d] (one projection's output) -> n tensors [B, H, T, d] (q, k, v), views of it.

    Unbinding the "3" axis before moving the heads makes autograd's backward one `stack` along that
    axis, written straight into the projection's [B, T, 3·H·d] layout. Permuting first (3 to the
    front, then unbind) stacked into [3, B, H, T, d] and copied that again to feed the projection's
    matmul: one extra pass over the q/k/v gradients, eager and compiled (inductor fused the two
    copies but kept both passes; ~3 ms of a 60 ms layer step at T = 1024).
    """
    return tuple(part.transpose(1, 2) for part in qkv.unbind(2))


def keeps_contract(forward: Callable[..., AttentionOutput]) -> Callable[..., AttentionOutput]:
    """Wrap a layer's `forward` with the parts of the contract no mechanism should re-implement:

    - padded rows (mask False) may hold anything, NaN included: they are replaced by zeros before
      the mechanism sees them. Masking downstream (scores, states, pooling) keeps padded keys out
      of real rows, but only finite padded values make that exact: a masked weight 0 times a NaN
      value is still NaN. `masked_fill`, not a multiplication, for the same reason; its gradient
      into padded rows is exactly zero.
    - T = 0 or B = 0: an empty output of the input's shape, zero aux_loss and zero flops (after the
      usual validation), without running kernels that reshape by -1 or divide by the length.
    - `documents` (packed sequences, ids [B, T]; attention/documents.py): validated, then
      `forward_documents` runs each document as if alone; a row holding one document takes the
      ordinary call.
    - `AttentionOutput.backends`: the backend every op of the call ran on (ops/backends.py).

    `AttentionLayer.__init_subclass__` applies it to every subclass that defines `forward`, so a
    new mechanism keeps these invariants the day it is registered.
    """
    if getattr(forward, "keeps_contract", False):
        return forward

    @functools.wraps(forward)
    def forward_with_contract(self, x: Tensor, *, mask: Tensor | None = None,
                              positions: Tensor | None = None, documents: Tensor | None = None,
                              **extra) -> AttentionOutput:
        if torch.compiler.is_compiling():  # nothing to record (see AttentionOutput.backends)
            return contract_call(self, x, mask=mask, positions=positions, documents=documents, **extra)
        with recording() as ran:
            result = contract_call(self, x, mask=mask, positions=positions, documents=documents, **extra)
        result.backends = dict(ran)
        return result

    def contract_call(self, x: Tensor, *, mask: Tensor | None, positions: Tensor | None,
                      documents: Tensor | None, **extra) -> AttentionOutput:
        self.check_input_tensor(x, mask, positions)
        if documents is not None:
            self.check_inputs(x, mask, positions)
            check_documents(documents, x.shape[0], x.shape[1])
            self.check_packable()
        if x.dim() == 3 and (x.shape[0] == 0 or x.shape[1] == 0):
            self.check_inputs(x, mask, positions)
            return self.empty_output(x)
        if mask is not None and mask.dtype == torch.bool and mask.shape == x.shape[:2]:
            x = x.masked_fill(~mask[..., None], 0.0)
        if documents is not None and bool(document_starts(documents)[:, 1:].any()):
            return self.forward_documents(x, mask=mask, positions=positions, documents=documents, **extra)
        # One document per row (or none given): the ordinary call; positions default to arange,
        # which is each row's document positions.
        return forward(self, x, mask=mask, positions=positions, **extra)

    forward_with_contract.keeps_contract = True
    return forward_with_contract


class AttentionLayer(nn.Module):
    """Base class: validation, multi-head Q/K/V/O projections, optional rotary positions.

    Subclasses implement `attend(q, k, v, mask) -> (heads_out [B, H, T, d], flops)`; mechanisms
    that need more (routers, extra tokens) override `forward` and reuse the helpers. Every
    `forward` is wrapped by `keeps_contract` (padded rows zeroed, empty inputs answered).

    Common options (every registered mechanism takes them):
        head_dim: size d of a head (default dim // heads; dim must then be divisible by heads).
        bias: biases in the Q/K/V and output projections (default False).
        rotary: rotary position embedding of q and k (default False; needs an even head_dim).
        rotary_base: the rotary base (default 10000).
        kv_heads: key/value heads G (default heads): grouped-query attention, K and V projected to
            G heads and query head h reading K/V head h // (heads // G); decoding caches hold G
            heads. ValueError unless G >= 1 divides heads, or when the mechanism does not read
            grouped K/V (`reads_grouped_kv` False) and G != heads.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in vars(cls):
            cls.forward = keeps_contract(vars(cls)["forward"])

    # -- what callers ask of a mechanism (attention.registry: attention_class(name).<trait>) ---
    # Declared by `register_attention(name, ...)` for each registered class; these are the values
    # of a layer nobody registered.
    is_baseline = False  # the mechanism the others are measured against (full)
    needs_meta_tokens = False  # reads meta-tokens a task injects (meta_tokens): the LM only
    grid_aware = False  # takes a ViT's patch grid and CLS token (options grid, extra_tokens)
    every_parameter_used = False  # no parameter can go without gradient (DDP: no unused search)
    # The mechanism takes kv_heads < heads (its attend/decode read K/V of kv_heads heads).
    reads_grouped_kv = False

    @classmethod
    def budget_options(cls, seq_len: int, keys: int) -> dict[str, Any]:
        """The options that give this mechanism its budget at length `seq_len` when a query may
        read up to `keys` keys (compare's budgets, compare/budgets.py); every other option stays
        at its default. Default: none (the mechanism has no length-dependent budget)."""
        return {}

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, head_dim: int | None = None,
        bias: bool = False, rotary: bool = False, rotary_base: float = 10000.0,
        kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        check_positive("dim", dim)
        check_positive("heads", heads)
        if head_dim is None:
            if dim % heads:
                raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}), or pass head_dim")
            head_dim = dim // heads
        check_positive("head_dim", head_dim)
        if rotary and head_dim % 2:
            raise ValueError(f"rotary=True needs an even head_dim; got {head_dim}")
        self.dim, self.heads, self.head_dim, self.causal = dim, heads, head_dim, bool(causal)
        self.rotary, self.rotary_base = rotary, rotary_base
        kv_heads = heads if kv_heads is None else kv_heads
        check_kv_heads(heads, kv_heads)
        if kv_heads != heads and not self.reads_grouped_kv:
            raise ValueError(f"{type(self).__name__} has no grouped-query form: kv_heads must equal "
                             f"heads ({heads}); got kv_heads={kv_heads}")
        self.kv_heads = kv_heads
        inner = heads * head_dim
        # One projection: q (heads·d), then k and v (kv_heads·d each).
        self.qkv_proj = nn.Linear(dim, inner + 2 * kv_heads * head_dim, bias=bias)
        self.out_proj = nn.Linear(inner, dim, bias=bias)

    # -- helpers ---------------------------------------------------------------------------
    def check_inputs(
        self, x: Tensor, mask: Tensor | None, positions: Tensor | None
    ) -> tuple[Tensor | None, Tensor]:
        """Validate the call and return (mask, positions) with positions defaulted to arange."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, T, {self.dim}]; got {tuple(x.shape)}")
        batch, length, _ = x.shape
        if mask is not None:
            if mask.dtype != torch.bool or mask.shape != (batch, length):
                raise ValueError(
                    f"mask must be a bool tensor of shape [B, T] = {(batch, length)}; "
                    f"got {mask.dtype} {tuple(mask.shape)}"
                )
            # Nothing padded: take the unmasked fast paths. Eager only: the test reads the mask's
            # values, which a compiled graph cannot branch on (it keeps the masked path there).
            if not torch.compiler.is_compiling() and bool(mask.all()):
                mask = None
        if positions is None:
            positions = torch.arange(length, device=x.device).expand(batch, length)
        elif positions.shape != (batch, length) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"positions must be an integer tensor of shape [B, T] = {(batch, length)}; "
                f"got {positions.dtype} {tuple(positions.shape)}"
            )
        elif not torch.compiler.is_compiling() and positions.numel() and bool((positions < 0).any()):
            raise ValueError(f"positions must be >= 0; got a minimum of {int(positions.min())}")
        return mask, positions

    def check_input_tensor(self, x: Tensor, mask: Tensor | None, positions: Tensor | None) -> None:
        """Raise TypeError unless x is a floating tensor on the layer's device, of the layer's dtype
        (any floating dtype under autocast, which casts at the projections), and mask / positions
        are tensors or None. Reads no tensor values."""
        for name, value in (("mask", mask), ("positions", positions)):
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None; got {type(value).__name__}")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor [B, T, {self.dim}]; got {type(x).__name__}")
        weight = next(self.parameters(), None)
        if weight is None:
            return
        if x.device != weight.device:
            raise TypeError(f"x is on {x.device} but the layer's parameters are on {weight.device}; "
                            f"move one of them (layer.to(x.device))")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating tensor; got {x.dtype}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x has dtype {x.dtype} but the layer's parameters are {weight.dtype}; "
                            f"cast one of them (x.to({weight.dtype}) or layer.to({x.dtype})), "
                            f"or run under torch.autocast")

    def empty_output(self, x: Tensor) -> AttentionOutput:
        """The output for an input with no tokens (T = 0 or B = 0): empty, connected to x."""
        return AttentionOutput(out=x * 0.0, aux_loss=x.new_zeros(()),
                               stats={"flops": torch.tensor(0.0)})

    def project_qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, D] -> q [B, H, T, d] and k, v [B, kv_heads, T, d], rotary applied to q and k
        when enabled."""
        return self.split_projection(self.qkv_proj(x), positions)

    def split_projection(self, projected: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A Q/K/V projection's output [B, T, (H + 2·kv_heads)·d] (q's heads, then k's, then v's)
        -> q [B, H, T, d], k, v [B, kv_heads, T, d] (views), rotary applied to q and k when enabled."""
        batch, length, _ = projected.shape
        if self.kv_heads == self.heads:
            q, k, v = split_qkv(projected.view(batch, length, 3, self.heads, self.head_dim))
        else:
            query_width, key_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
            parts = projected.split([query_width, key_width, key_width], dim=-1)
            q, k, v = (part.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for part in parts)
        return self.rotate(q, positions), self.rotate(k, positions), v

    def rotate(self, t: Tensor, positions: Tensor) -> Tensor:
        """Rotary embedding of t [B, H, L, d] at `positions` [B, L]; identity when rotary is off."""
        if not self.rotary:
            return t
        cos, sin = rotary_angles(positions, self.head_dim, self.rotary_base)
        return apply_rotary(t, cos, sin)

    def merge_heads(self, heads_out: Tensor, x: Tensor) -> Tensor:
        """[B, H, T, d] -> [B, T, H·d]; the hook where gated attention applies its gate."""
        batch, _, length, _ = heads_out.shape
        return heads_out.transpose(1, 2).reshape(batch, length, -1)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, int]:
        """The mechanism itself: q, k, v [B, H, T, d] -> (heads_out [B, H, T, d], executed FLOPs)."""
        raise TypeError(f"{type(self).__name__} must define attend() or override forward()")

    # -- the contract ----------------------------------------------------------------------
    @keeps_contract
    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None
    ) -> AttentionOutput:
        mask, positions = self.check_inputs(x, mask, positions)
        q, k, v = self.project_qkv(x, positions)
        with profile_range("attention"):  # `routeformer bench layers --split` reads it
            heads_out, flops = self.attend(q, k, v, mask)
        out = self.out_proj(self.merge_heads(heads_out, x))
        return AttentionOutput(
            out=out,
            aux_loss=x.new_zeros(()),
            stats={"flops": torch.tensor(float(flops))},
        )

    # -- packed documents (attention/documents.py) -------------------------------------------
    def check_packable(self) -> None:
        """Raise ValueError (naming the mechanism) if this layer cannot run packed documents."""

    def forward_documents(
        self, x: Tensor, *, mask: Tensor | None, positions: Tensor | None, documents: Tensor, **extra
    ) -> AttentionOutput:
        """The layer on a packed batch: every document (a run of equal `documents` ids in a row)
        as if alone. Default: run the documents separately, grouped by length
        (`attention.documents.run_per_document`); mechanisms with a segmented path override it."""
        from routeformer.attention.documents import run_per_document

        return run_per_document(self, x, mask=mask, positions=positions, documents=documents, **extra)

    # -- cached decoding (CausalLM.generate) -------------------------------------------------
    # Layers that can decode incrementally set this and define decode_attend (or decode).
    supports_cache = False

    def decode(self, x: Tensor, *, positions: Tensor, cache: dict, meta_mask: Tensor | None = None) -> Tensor:
        """Cached incremental forward pass: x [B, t, D] are the next t tokens of a stream whose
        earlier tokens this layer has seen through `cache` (a dict the layer owns; start with {}).
        Returns out [B, t, D], equal to the rows of the parallel forward pass over the whole stream.
        No padding mask: every token of the stream is real."""
        self.check_decode(x, positions)
        start = cache.get("length", 0)
        q, k, v = self.project_qkv(x, positions)
        heads_out = self.decode_attend(q, k, v, start, cache)
        cache["length"] = start + x.shape[1]
        return self.out_proj(self.merge_heads(heads_out, x))

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict) -> Tensor:
        """The mechanism, cached: new q, k, v [B, H, t, d] of indices start.. -> heads_out."""
        # Unreachable through decode(): check_decode rejects layers with supports_cache = False.
        raise TypeError(f"{type(self).__name__} sets supports_cache but defines no decode_attend()")

    def decode_read_bytes(self, cache: dict) -> tuple[int, bool]:
        """(bytes of cached state one decoding step reads, exact), for this layer's `cache`: the
        live keys/values a step attends over, the routing keys it scans, the recurrent state it
        reads. Default, for a mechanism that reads a data-dependent part of its state (meta's
        experts, mita's routed experts, meta_tokens' meta keys): the state's live tensors, an upper
        bound (exact=False)."""
        return state_live_bytes(cache), False

    def check_decode(self, x: Tensor, positions: Tensor) -> None:
        if not self.supports_cache:
            raise ValueError(f"{type(self).__name__} has no cached decoding (supports_cache=False)")
        if not self.causal:
            raise ValueError("cached decoding needs a causal layer (causal=True)")
        self.check_inputs(x, None, positions)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, causal={self.causal}, "
            f"rotary={self.rotary}" + (f", kv_heads={self.kv_heads}" if self.kv_heads != self.heads else "")
        )



def live_bytes(value) -> int:
    """Bytes of `value` if it is a tensor (its live elements, not its storage), else 0."""
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def state_live_bytes(state) -> int:
    """Bytes of every tensor in a decoding state (nested dicts), reserved `*_buffer`s left out."""
    if isinstance(state, dict):
        return sum(state_live_bytes(value) for key, value in state.items() if not key.endswith("_buffer"))
    return live_bytes(state)


def key_value_bytes(cache: dict) -> int:
    """Bytes of the live keys and values a softmax step attends over (`k`, `v` of its cache)."""
    return live_bytes(cache["k"]) + live_bytes(cache["v"])


STEADY_STATE_STEP = 10**9  # past any warm-up or annealing a layer schedules


def skip_schedules(model: nn.Module, routing_shares: tuple[float, ...] | None = None) -> None:
    """Move every attention layer of `model` past its training schedules: its step counters (integer
    buffers — meta's `routing_step`, topk's `distill_step`) are set beyond any warm-up or annealing,
    so a training step runs what the layer runs at the end of a curriculum (meta's hard routing at
    `train_eta`, topk's sparse distillation). With `routing_shares`, every layer that can
    (`force_routing`: meta) is also hard-routed at those shares of tokens per expert, as a trained
    router routes. For timing a fresh model at its steady state."""
    for module in model.modules():
        if isinstance(module, AttentionLayer):
            for buffer in module.buffers():
                if not buffer.is_floating_point() and not buffer.is_complex() and buffer.dim() == 0:
                    buffer.fill_(STEADY_STATE_STEP)
            if routing_shares is not None and hasattr(module, "force_routing"):
                module.force_routing(tuple(routing_shares))
