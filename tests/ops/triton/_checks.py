"""Assertions shared by the Triton kernel tests."""

import torch


def assert_same_gradients(got, want, weight, leaves, atol=1e-5, rtol=1e-5):
    """The gradients of (got · weight).sum() and (want · weight).sum() with respect to `leaves` agree."""
    for a, b in zip(torch.autograd.grad((got * weight).sum(), leaves),
                    torch.autograd.grad((want * weight).sum(), leaves), strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
