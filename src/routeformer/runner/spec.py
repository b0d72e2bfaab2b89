"""A training run as one typed spec: a `runner.jobs.Job` (task and its options, mechanism and its
options, seed, the setup's stages and evaluations, backbone, precision, AdamW's betas and weight
decay) read back from the JSON that `job_config` writes — a task run directory's `config.json`, a
compare run's job — or from YAML of the same shape.

`job_from_dict(job_config(job)) == job` for every job; each value is typed by the field it lands in
(train/config_types.py: `3e-4` and `1_000` are numbers, an int field takes no fraction). Dotted
overrides (`seed=2`, `spec.dim=128`, `setup.schedule.steps=100`, `options.topk=8`) change the data
before it is typed. `routeformer train --spec FILE` trains a spec in a run directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from routeformer.runner.jobs import JOB_FIELD_DEFAULTS, Job
from routeformer.runner.setups import Stage, TaskSetup
from routeformer.train.config_types import coerce, field_types
from routeformer.train.on_task import SPEC_DEFAULTS, ModelSpec
from routeformer.train.schedule import Schedule

__all__ = ["job_from_dict", "load_spec", "with_overrides"]

_REQUIRED = ("key", "task", "task_options", "mechanism", "options", "seed", "setup")


def _typed(kind: type, values: Any, name: str, defaults: dict[str, Any] | None = None,
           skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`values` (a mapping) as keyword arguments of the dataclass `kind`: every key a field (`skip`
    excepted), each value coerced to its field's type, `defaults` filled in first. ValueError naming
    `name.key` for an unknown key or a value its type does not take."""
    if not isinstance(values, dict):
        raise ValueError(f"{name} must be a mapping; got {values!r}")
    types = {key: value for key, value in field_types(kind).items() if key not in skip}
    unknown = sorted(set(values) - set(types) - set(skip))
    where = f"{name}." if name else ""
    if unknown:
        raise ValueError(f"{where}{unknown[0]}: not a key of the run spec{' ' + name if name else ''}; "
                         f"keys there: {sorted(types)}")
    values = {**(defaults or {}), **values}
    return {key: coerce(f"{where}{key}", value, types[key]) for key, value in values.items()
            if key in types}


def _schedule(values: Any, name: str) -> Schedule:
    return Schedule(**_typed(Schedule, values, name))


def _setup(values: Any) -> TaskSetup:
    """A TaskSetup from `TaskSetup.as_dict`'s data."""
    staged = ("schedule", "curriculum", "eval_multiples")
    typed = _typed(TaskSetup, values, "setup", skip=staged)
    if "schedule" not in values:
        raise ValueError("setup.schedule: missing (steps, batch_size, lr, warmup_steps, ...)")
    stages = values.get("curriculum", [])
    if not isinstance(stages, list):
        raise ValueError(f"setup.curriculum must be a list of stages; got {stages!r}")
    curriculum = []
    for index, stage in enumerate(stages):
        name = f"setup.curriculum[{index}]"
        if not isinstance(stage, dict) or set(stage) != {"options", "schedule"}:
            raise ValueError(f"{name} must be a mapping with the keys options and schedule; got {stage!r}")
        curriculum.append(Stage(coerce(f"{name}.options", stage["options"], dict[str, Any]),
                                _schedule(stage["schedule"], f"{name}.schedule")))
    multiples = coerce("setup.eval_multiples", values.get("eval_multiples", []), list[int])
    return TaskSetup(**typed, schedule=_schedule(values["schedule"], "setup.schedule"),
                     curriculum=tuple(curriculum), eval_multiples=tuple(multiples))


def job_from_dict(data: Any) -> Job:
    """The Job `data` states (`job_config`'s JSON form; module docstring). Fields `job_config` leaves
    out at their defaults (spec.tie_embeddings, precision, betas, weight_decay) take them.

    Raises ValueError naming the key for a missing or unknown key or a value of the wrong type, and
    as `Job`, `TaskSetup` and `ModelSpec` do for values they refuse."""
    if not isinstance(data, dict):
        raise ValueError(f"a run spec must be a mapping of keys to values; got {data!r}")
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{missing[0]}: missing from the run spec (it needs {list(_REQUIRED)})")
    typed = _typed(Job, data, "", JOB_FIELD_DEFAULTS, skip=("setup", "spec", "betas"))
    betas = data.get("betas", JOB_FIELD_DEFAULTS["betas"])
    typed["betas"] = tuple(coerce("betas", list(betas) if isinstance(betas, tuple) else betas, list[float]))
    model = ModelSpec(**_typed(ModelSpec, data.get("spec", {}), "spec", SPEC_DEFAULTS))
    return Job(**typed, setup=_setup(data["setup"]), spec=model)


def with_overrides(data: dict[str, Any], overrides: list[tuple[str, str]]) -> dict[str, Any]:
    """`data` with each (dotted path, text) of `overrides` set: the text read as YAML, the path's
    parents existing mappings (a new last key is allowed where the parent is an options mapping:
    `options`, `task_options`, `setup.options`). ValueError naming a path that leads nowhere."""
    data = json.loads(json.dumps(data))
    open_ended = ("options", "task_options", "setup.options", "setup.mechanism_options")
    for path, text in overrides:
        *parents, last = path.split(".")
        node: Any = data
        for depth, key in enumerate(parents):
            node = node.get(key) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                raise ValueError(f"--{path}: {'.'.join(parents[:depth + 1])!r} is no mapping of the run spec")
        if last not in node and ".".join(parents) not in open_ended:
            raise ValueError(f"--{path}: no such key in the run spec; keys there: {sorted(node)}")
        try:
            node[last] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ValueError(f"--{path}: cannot read {text!r} as a value") from None
    return data


def load_spec(path: str | Path, overrides: list[tuple[str, str]] = ()) -> Job:
    """The Job in the JSON or YAML file at `path` (a run directory: its config.json), with
    `overrides` applied (`with_overrides`). ValueError naming the file when it cannot be read."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"argument --spec: cannot read {str(path)!r} ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"argument --spec: {str(path)!r} holds no mapping of keys to values")
    return job_from_dict(with_overrides(data, list(overrides)))
