"""routeformer: routed attention for PyTorch."""

__version__ = "0.1.0"
