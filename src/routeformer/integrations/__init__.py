"""Bridges to other libraries (optional dependencies, imported on use)."""
