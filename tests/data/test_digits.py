"""The digits loader: split sizes, pixel range, upsampling."""

import pytest
import torch

from routeformer.data.digits import load_digits
from tests.extras import require

require("sklearn", "vision")


def test_digits_split_and_upsampling():
    train, test = load_digits()
    assert train.images.shape == (1438, 1, 8, 8) and test.images.shape == (359, 1, 8, 8)
    assert 0.0 <= float(train.images.min()) and float(train.images.max()) <= 1.0
    assert set(test.labels.tolist()) == set(range(10))
    big_train, _ = load_digits(16)
    assert big_train.images.shape == (1438, 1, 16, 16)
    torch.testing.assert_close(big_train.labels, train.labels)
    with pytest.raises(ValueError, match="size must be an integer >= 8"):
        load_digits(4)
