"""Tokenised corpora cached on disk and memory-mapped, so a second run skips tokenising.

The cache key is the SHA-256 of the tokeniser (its `to_dict`, as JSON) and the text, so a changed
text or tokeniser never reads a stale entry. An entry is the raw little-endian int64 ids in
`<cache>/tokens/<key>.i64`, written atomically (temporary file, rename: concurrent runs or DDP
ranks may write the same entry) and read back with `torch.from_file`, a private memory map: the
operating system pages the ids in as batches touch them and shares them between runs.

The cache directory is `$ROUTEFORMER_CACHE_DIR`, else `$XDG_CACHE_HOME/routeformer`, else
`~/.cache/routeformer`; `ROUTEFORMER_CACHE_DIR=off` disables caching.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

from routeformer.data.tokenizers import Tokenizer

_ITEM = 8  # bytes per id (int64: what embeddings and losses take without a copy)


def cache_dir() -> Path | None:
    """Where tokenised corpora are kept (None: caching disabled)."""
    configured = os.environ.get("ROUTEFORMER_CACHE_DIR")
    if configured is not None:
        return None if configured.lower() in ("", "off", "0", "none") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "routeformer"


def cache_key(tokenizer: Tokenizer, text: str) -> str:
    digest = hashlib.sha256(json.dumps(tokenizer.to_dict(), sort_keys=True).encode())
    digest.update(b"\0")
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def encode_cached(tokenizer: Tokenizer, text: str, directory: Path | None = None) -> Tensor:
    """`tokenizer.encode(text)` (int64), from the cache when an entry exists, else computed and stored."""
    directory = directory if directory is not None else cache_dir()
    if directory is None:
        return tokenizer.encode(text)
    path = directory / "tokens" / f"{cache_key(tokenizer, text)}.i64"
    if path.is_file() and path.stat().st_size % _ITEM == 0:
        count = path.stat().st_size // _ITEM
        if count == 0:
            return torch.empty(0, dtype=torch.long)
        return torch.from_file(str(path), shared=False, size=count, dtype=torch.long)
    ids = tokenizer.encode(text).to(torch.long).contiguous()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(ids.numpy().astype("<i8", copy=False).tobytes())
        os.replace(temporary, path)
    except OSError as error:  # a read-only or full disk costs the cache, never the run
        print(f"routeformer: warning: tokenised corpus not cached in {str(directory)!r} ({error})",
              file=sys.stderr, flush=True)
    return ids
