"""Reproduced paper results, by name: `routeformer reproduce NAME` (see docs/design.md).

An experiment is a function `run(out_dir: Path, quick: bool) -> Path` that writes `result.json`,
`report.md` (the paper's numbers beside ours) and PNG plots under `out_dir`, and returns the
report's path. Experiments made of several training runs keep one JSON per finished run in
`out_dir/runs/`, so an interrupted experiment resumes without repeating them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    run: Callable[[Path, bool], Path]


_EXPERIMENTS: dict[str, Experiment] = {}


def register_experiment(name: str, description: str) -> Callable:
    def decorate(function: Callable[[Path, bool], Path]) -> Callable[[Path, bool], Path]:
        if name in _EXPERIMENTS:
            raise ValueError(f"experiment {name!r} is already registered")
        _EXPERIMENTS[name] = Experiment(name, description, function)
        return function
    return decorate


def _load_all() -> None:
    # Importing the modules registers their experiments.
    from routeformer.experiments import (  # noqa: F401
        central_claims,
        meta_attention,
        meta_attention_matched,
        meta_tokens_recall,
        mita,
        mita_tasks,
        mqar_sweep,
        structural_multihop,
        structural_recency,
        structural_speed,
        structural_update,
        topk,
        topk_routing_learning,
    )


def list_experiments() -> dict[str, Experiment]:
    _load_all()
    return dict(sorted(_EXPERIMENTS.items()))


def run_experiment(name: str, out_dir: str | Path | None = None, *, quick: bool = False) -> Path:
    experiments = list_experiments()
    if name not in experiments:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(experiments)}")
    out = Path(out_dir) if out_dir is not None else Path("runs") / (name + ("-quick" if quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    return experiments[name].run(out, quick)
