"""Hugging Face `transformers` integration (optional: `pip install routeformer[hf]`).

- `patch_attention(model, mechanism, **options)`: a GPT-2 or Llama-family transformers model with a
  routeformer mechanism in place of its attention (patch.py); `from_pretrained(path)` reloads one
  saved with `save_pretrained` (loading.py).
- `RouteformerConfig` / `RouteformerForCausalLM`: routeformer's own causal LM as a transformers
  model (model.py), registered with `AutoConfig` and `AutoModelForCausalLM` on import.
- Cached generation in both through routeformer's decode caches (cache.py).
- `register()`: routeformer's attention as transformers' `attn_implementation="routeformer"`
  (AttentionInterface / AttentionMaskInterface; interface.py), done on import; DeepSeek-V3.2's
  sparse indices run through routeformer's gathered-keys kernel.
- `patch_indexer(model)`: DeepSeek-V3.2's indexer scored in query blocks over each block's causal
  prefix, with transformers' indices (indexer.py).
- `sparsify_pretrained(model, "topk", batches, steps=...)`: a dense pretrained model converted to
  routed attention by train/sparsify.py's two stages (sparsify.py).
- `export_hf(run_dir, out_dir)`: a `routeformer train` checkpoint in this format (export.py).
"""

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("routeformer.integrations.hf needs transformers: "
                      "pip install 'routeformer[hf]'") from error

from transformers import AutoConfig, AutoModelForCausalLM

from routeformer.integrations.hf.cache import RouteformerCacheLayer
from routeformer.integrations.hf.indexer import patch_indexer
from routeformer.integrations.hf.interface import register, routeformer_attention
from routeformer.integrations.hf.loading import PatchedConfig, PatchedForCausalLM, from_pretrained
from routeformer.integrations.hf.model import (
    RouteformerCausalLMOutput,
    RouteformerConfig,
    RouteformerForCausalLM,
)
from routeformer.integrations.hf.patch import (
    RouteformerAttention,
    key_padding_mask,
    patch_attention,
    routeformer_aux_loss,
    routeformer_layers,
)
from routeformer.integrations.hf.sparsify import sparsify_pretrained

AutoConfig.register("routeformer", RouteformerConfig, exist_ok=True)
AutoModelForCausalLM.register(RouteformerConfig, RouteformerForCausalLM, exist_ok=True)
AutoConfig.register(PatchedConfig.model_type, PatchedConfig, exist_ok=True)
AutoModelForCausalLM.register(PatchedConfig, PatchedForCausalLM, exist_ok=True)
register()

__all__ = [
    "RouteformerAttention", "RouteformerCausalLMOutput", "RouteformerConfig", "RouteformerForCausalLM",
    "RouteformerCacheLayer", "from_pretrained", "key_padding_mask", "patch_attention", "patch_indexer",
    "register", "routeformer_attention", "routeformer_aux_loss", "routeformer_layers", "sparsify_pretrained",
]
