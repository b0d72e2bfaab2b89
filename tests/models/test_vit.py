"""ViT: patch order, CLS pooling, grid options handed to mita, errors."""

import pytest
import torch

from routeformer.models.config import ModelConfig
from routeformer.models.vit import VisionConfig, ViT


def make(attention="full", options=None, size=4, patch=2, channels=1):
    torch.manual_seed(0)
    config = ModelConfig(dim=16, depth=1, heads=2, attention=attention, causal=False, num_classes=3,
                         attention_options={attention: options} if options else {})
    return ViT(config, VisionConfig(image_size=size, patch_size=patch, channels=channels))


def test_patches_are_row_major_blocks_of_the_image():
    model = make(size=4, patch=2)
    image = torch.arange(16.0).view(1, 1, 4, 4)
    patches = model.patchify(image)
    assert patches.shape == (1, 4, 4)
    torch.testing.assert_close(patches[0, 1], torch.tensor([2.0, 3.0, 6.0, 7.0]))  # top-right block


def test_logits_read_the_cls_token_and_every_patch():
    model = make().eval()
    images = torch.rand(2, 1, 4, 4)
    base = model(images).logits
    changed = images.clone()
    changed[1, 0, 3, 3] += 1.0  # the last patch of the second image
    out = model(changed).logits
    torch.testing.assert_close(out[0], base[0])
    assert not torch.allclose(out[1], base[1])


def test_training_step_reaches_every_used_parameter():
    model = make("mita", {"landmarks": 2, "topk": 2})
    output = model(torch.rand(3, 1, 4, 4), torch.tensor([0, 1, 2]))
    output.total_loss.backward()
    for name, parameter in model.named_parameters():
        if name != "backbone.token_embedding.weight":  # patches are embedded, not tokens
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_mita_gets_the_patch_grid_and_skips_the_cls_token():
    model = make("mita", {"landmarks": 4, "topk": 2}, size=8, patch=2)
    layer = model.backbone.blocks[0].attention
    assert layer.grid == (4, 4) and layer.extra_tokens == 1
    explicit = make("mita", {"landmarks": 4, "topk": 2, "grid": [2, 8]}, size=8, patch=2)
    assert explicit.backbone.blocks[0].attention.grid == (2, 8)  # the config's own value wins


def test_bad_configs_and_images_raise_value_errors():
    with pytest.raises(ValueError, match="patch_size .3. must divide"):
        VisionConfig(image_size=8, patch_size=3)
    with pytest.raises(ValueError, match="ViT needs model.causal = False"):
        ViT(ModelConfig(dim=16, heads=2, depth=1), VisionConfig())
    with pytest.raises(ValueError, match=r"images must have shape \[B, 1, 4, 4\]"):
        make()(torch.rand(2, 1, 5, 5))
