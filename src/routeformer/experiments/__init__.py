"""Reproduced paper results (one module per experiment)."""
