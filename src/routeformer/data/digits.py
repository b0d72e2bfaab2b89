"""scikit-learn's bundled 8×8 handwritten digits (1797 images, 10 classes), as image tensors.

The data ship inside scikit-learn (nothing is downloaded); install it with
`pip install -c constraints.txt -e ".[vision]"`. Pixels (0..16) are scaled to [0, 1]; `size=16`
upsamples bilinearly to 16×16 (256 patch tokens at patch size 1). The split is a seeded random
permutation: the first `test_fraction` of it is the test set.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

NUM_CLASSES = 10
NATIVE_SIZE = 8


@functools.cache
def _native_digits() -> tuple[Tensor, Tensor]:
    """The 1797 images [N, 1, 8, 8] in [0, 1] and their labels, read once per process."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise ImportError("the digits experiments need scikit-learn: "
                          "pip install -c constraints.txt -e \".[vision]\"") from error
    bunch = sklearn_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0
    return images, torch.tensor(bunch.target, dtype=torch.long)


@dataclass
class ImageSplit:
    images: Tensor  # float [N, 1, S, S] in [0, 1]
    labels: Tensor  # long [N]


def load_digits(size: int = NATIVE_SIZE, *, test_fraction: float = 0.2, seed: int = 0
                ) -> tuple[ImageSplit, ImageSplit]:
    """(train, test) splits of the digits at `size`×`size` pixels (8 native, larger upsampled)."""
    if not isinstance(size, int) or size < NATIVE_SIZE:
        raise ValueError(f"size must be an integer >= {NATIVE_SIZE} (the native resolution); got {size!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1); got {test_fraction!r}")
    images, labels = _native_digits()
    if size != NATIVE_SIZE:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test_count = int(round(test_fraction * len(labels)))
    test, train = order[:test_count], order[test_count:]
    return ImageSplit(images[train], labels[train]), ImageSplit(images[test], labels[test])
