"""Reproduced paper results: one module per experiment (or per family of experiments), and the
training runs several of them share (recall_runs.py, structural_runs.py)."""
