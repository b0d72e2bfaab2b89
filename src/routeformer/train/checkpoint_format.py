"""The checkpoint payload without pickle: tensors in safetensors, everything else in JSON.

A training state is a nest of dicts, lists and tuples holding tensors, numbers, strings, booleans
and None (model and optimizer state dicts, RNG states, the config, the vocabulary). `encode`
splits it into a flat {name: tensor} map and a JSON skeleton in which every tensor is replaced by
`{"__tensor__": name}`; `decode` puts it back together. The bytes are a plain safetensors file
whose header metadata holds the skeleton under `routeformer.state`, so any safetensors reader
opens the weights, and reading a checkpoint never executes code from the file.

JSON cannot say everything Python can, so two shapes are tagged: a tuple is `{"__tuple__": [...]}`
and a dict with a key that is not a string (the optimizer's integer parameter ids) or that starts
with `__` is `{"__dict__": [[key, value], ...]}`. Any other object (a dataclass, a custom class)
is refused when saving, with its place in the state named.

Tensors that share memory (tied embeddings) are stored once and come back as separate tensors
holding the same values; `load_state_dict` copies them into the tied parameter either way.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from torch import Tensor

FORMAT = "routeformer-checkpoint-2"
_STATE_KEY = "routeformer.state"


def encode(state: dict[str, Any]) -> bytes:
    """The safetensors bytes of `state` (see the module docstring). ValueError naming the place of
    any value that is not a tensor, number, string, bool, None, list, tuple or dict."""
    from safetensors.torch import save

    tensors: dict[str, Tensor] = {}
    seen: dict[tuple, str] = {}

    def visit(value: Any, where: str) -> Any:
        if isinstance(value, Tensor):
            # Identity of the caller's tensor (alive throughout), never of a temporary copy.
            identity = (str(value.device), value.untyped_storage().data_ptr(), value.storage_offset(),
                        tuple(value.shape), tuple(value.stride()), value.dtype)
            name = seen.get(identity) if value.numel() else None
            if name is None:
                name = f"t{len(tensors)}"
                tensors[name] = value.detach().cpu().contiguous().clone()  # safetensors refuses shared memory
                seen[identity] = name
            return {"__tensor__": name}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {"__tuple__": [visit(item, f"{where}[{i}]") for i, item in enumerate(value)]}
        if isinstance(value, list):
            return [visit(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(key, str) and not key.startswith("__") for key in value):
                return {key: visit(item, f"{where}.{key}") for key, item in value.items()}
            return {"__dict__": [[visit(key, f"{where} key"), visit(item, f"{where}[{key!r}]")]
                                 for key, item in value.items()]}
        raise ValueError(f"checkpoint state {where or 'root'!r} holds a {type(value).__name__}; a checkpoint "
                         "stores only tensors, numbers, strings, booleans, None, lists, tuples and dicts")

    skeleton = visit(state, "")
    metadata = {"format": FORMAT, _STATE_KEY: json.dumps(skeleton)}
    return save(tensors, metadata=metadata)


def decode(payload: bytes) -> dict[str, Any]:
    """The state `encode` wrote. ValueError when the bytes are not such a payload."""
    from safetensors.torch import load

    metadata = read_metadata(payload)
    if metadata.get("format") != FORMAT or _STATE_KEY not in metadata:
        raise ValueError("a safetensors file, but not a routeformer checkpoint (no routeformer.state)")
    tensors = load(payload)

    def rebuild(value: Any) -> Any:
        if isinstance(value, list):
            return [rebuild(item) for item in value]
        if isinstance(value, dict):
            if "__tensor__" in value:
                return tensors[value["__tensor__"]]
            if "__tuple__" in value:
                return tuple(rebuild(item) for item in value["__tuple__"])
            if "__dict__" in value:
                return {rebuild(key): rebuild(item) for key, item in value["__dict__"]}
            return {key: rebuild(item) for key, item in value.items()}
        return value

    return rebuild(json.loads(metadata[_STATE_KEY]))


def read_metadata(payload: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header (an 8-byte little-endian length, then JSON)."""
    if len(payload) < 8:
        raise ValueError("too short for a safetensors header")
    (length,) = struct.unpack("<Q", payload[:8])
    if length > len(payload) - 8:
        raise ValueError("the safetensors header is longer than the file")
    header = json.loads(payload[8:8 + length])
    return header.get("__metadata__") or {}
