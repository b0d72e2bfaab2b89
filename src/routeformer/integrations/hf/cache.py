"""routeformer's decode caches behind transformers' cache API.

transformers hands every attention module a `Cache` (usually a `DynamicCache`) holding one layer
object per model layer, and asks it for the number of tokens seen (`get_seq_length`) to place
positions and build masks. A routeformer layer keeps its own decoding state (all keys/values for
`full`, the last `window` for `local`, a d×d state for `linear`: ops/decode.py), so the module puts
a `RouteformerCacheLayer` in its slot of that cache and stores the state there. transformers' own
bookkeeping (sequence length, mask sizes, beam reordering) then reads the right numbers.

A padded batch keeps one state per row (models/ragged.py). A cache that cannot continue exactly
(filled in training mode, or by a mechanism without cached decoding) is marked unusable with the
reason: reading it again raises a one-line ValueError that says to pass `use_cache=False`, never
a silently wrong continuation.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from routeformer.models.ragged import is_ragged, select_rows


class RouteformerCacheLayer(CacheLayerMixin):
    """One layer's routeformer decode state (`state`, the dict the attention layer's `decode` owns)
    and the number of tokens it has seen (`length`)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False  # nothing to allocate ahead: the state is built by decode

    def __init__(self) -> None:
        super().__init__()
        self.state: dict = {}
        self.length = 0
        self.unusable: str | None = None  # why this cache cannot continue exactly, if it cannot
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        raise ValueError("a routeformer cache layer holds a routeformer decode state, not keys/values; "
                         "it is filled by the routeformer attention module itself")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.x's name for get_max_length
        return -1

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.state, self.length, self.unusable = {}, 0, None

    def crop(self, tokens_to_remove: int) -> None:
        # A window or a linear-attention state cannot take tokens back out.
        if tokens_to_remove:
            raise ValueError("a routeformer cache cannot be cropped (assisted or speculative decoding); "
                             "pass use_cache=False")

    def _map_batch(self, function) -> None:
        # Every tensor of a decode state has the batch first (ops/decode.py: [B, H, ...]).
        self.state = {key: function(value) if isinstance(value, Tensor) and value.dim() > 0 else value
                      for key, value in self.state.items()}

    def _select_rows(self, index: Tensor) -> None:
        # A padded batch keeps one state per row (models/ragged.py): pick the rows' states.
        select_rows(self.state, index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if is_ragged(self.state):
            return self._select_rows(beam_idx)
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if is_ragged(self.state):
            rows = len(self.state["rows"])
            return self._select_rows(torch.arange(rows).repeat_interleave(repeats))
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        if is_ragged(self.state):
            rows = torch.arange(len(self.state["rows"]))
            return self._select_rows(rows[indices.cpu()] if isinstance(indices, Tensor) else rows[indices])
        self._map_batch(lambda t: t[indices])


def cache_layer(cache: Cache, layer_index: int) -> RouteformerCacheLayer:
    """The routeformer layer in slot `layer_index` of a transformers `cache`, put there if the slot
    is empty (a fresh DynamicCache/StaticCache layer). A slot that already holds another model's
    keys and values is refused: they cannot be turned into a routeformer state."""
    if not isinstance(cache, Cache):
        raise ValueError(f"past_key_values must be a transformers Cache; got {type(cache).__name__} "
                         "(legacy tuples of key/value tensors are not supported)")
    layers = cache.layers
    while len(layers) <= layer_index:
        layers.append(RouteformerCacheLayer())
    layer = layers[layer_index]
    if isinstance(layer, RouteformerCacheLayer):
        return layer
    if isinstance(layer, CacheLayerMixin) and layer.get_seq_length() == 0:
        layers[layer_index] = RouteformerCacheLayer()
        return layers[layer_index]
    raise ValueError(f"past_key_values: layer {layer_index} already holds a {type(layer).__name__} "
                     "that routeformer cannot continue from; start generation with an empty cache")


def check_usable(layer: RouteformerCacheLayer) -> None:
    if layer.unusable is not None:
        raise ValueError(f"cached generation cannot continue exactly: {layer.unusable}; pass use_cache=False")
