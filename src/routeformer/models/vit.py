"""ViT: images -> patch tokens + a CLS token -> the Transformer backbone (non-causal) -> classes.

    tokens = [CLS; Linear(patches)] + learned position embedding;  logits = Linear(h_CLS)

Mechanisms that pool over the image grid (registered `grid_aware`: `mita`) get `grid=(rows, cols)`
of the patch grid and `extra_tokens=1` (the CLS token stays out of the pooling) unless the config sets them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.attention import attention_class
from routeformer.models.config import ModelConfig
from routeformer.models.heads import ModelOutput
from routeformer.models.transformer import Transformer, init_weights
from routeformer.ops._checks import check_positive


@dataclass
class VisionConfig:
    image_size: int = 8  # square images of image_size x image_size pixels
    patch_size: int = 1
    channels: int = 1

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels"):
            check_positive(f"vision.{name}", getattr(self, name))
        if self.image_size % self.patch_size:
            raise ValueError(f"vision.patch_size ({self.patch_size}) must divide vision.image_size "
                             f"({self.image_size})")

    @property
    def grid(self) -> tuple[int, int]:
        side = self.image_size // self.patch_size
        return side, side

    @property
    def num_tokens(self) -> int:
        """Patches plus the CLS token."""
        return self.grid[0] * self.grid[1] + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ViT(nn.Module):
    """Vision Transformer classifier (CLS pooling) on the routeformer backbone."""

    def __init__(self, config: ModelConfig, vision: VisionConfig) -> None:
        super().__init__()
        if config.causal:
            raise ValueError("ViT needs model.causal = False (every patch sees the whole image)")
        options = {name: dict(values) for name, values in config.attention_options.items()}
        # Mechanisms told the patch grid and the CLS token (grid_aware: options grid, extra_tokens).
        for name in dict.fromkeys(config.layer_attention()):
            if not attention_class(name).grid_aware:
                continue
            options.setdefault(name, {})
            options[name].setdefault("grid", vision.grid)
            options[name].setdefault("extra_tokens", 1)
        # The backbone adds learned positions to the embedded patches; it needs no vocabulary.
        self.config = replace(config, attention_options=options, positions="learned",
                              max_seq_len=max(config.max_seq_len, vision.num_tokens), vocab_size=1)
        self.vision = vision
        self.patch_embedding = nn.Linear(vision.channels * vision.patch_size ** 2, config.dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.backbone = Transformer(self.config)
        self.classifier = nn.Linear(config.dim, config.num_classes)
        init_weights(self.patch_embedding)
        init_weights(self.classifier)

    def patchify(self, images: Tensor) -> Tensor:
        """[B, C, S, S] -> [B, patches, C·p·p], patches in row-major order of the grid."""
        expected = (self.vision.channels, self.vision.image_size, self.vision.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must have shape [B, {', '.join(map(str, expected))}]; "
                             f"got {tuple(images.shape)}")
        patch = self.vision.patch_size
        return F.unfold(images, kernel_size=patch, stride=patch).transpose(1, 2)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> ModelOutput:
        patches = self.patch_embedding(self.patchify(images))
        tokens = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        result = self.backbone(None, inputs_embeds=tokens)
        logits = self.classifier(result.hidden[:, 0])
        loss = None if labels is None else F.cross_entropy(logits.float(), labels)
        return ModelOutput(logits, loss, result.aux_loss, result.stats)
