"""One `Schedule` (train/schedule.py) states steps, batch size, learning rate and warm-up for every
config that trains; the budgets and defaults expressed through it are those of before (pinned)."""

import ast
from pathlib import Path

import pytest

import routeformer
from routeformer.compare.budgets import FULL, LONG, QUICK
from routeformer.experiments.recall_runs import RecallRun
from routeformer.train.config import RunConfig, TrainConfig, load_config
from routeformer.train.task_loop import TaskTrainConfig

SOURCE = Path(routeformer.__file__).parent
CONFIGS = SOURCE / "configs"


def _four(schedule):
    return schedule.steps, schedule.batch_size, schedule.lr, schedule.warmup_steps


def test_only_one_dataclass_declares_the_schedule_fields():
    declared = []
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                declared += [f"{path.relative_to(SOURCE)}:{node.name}" for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                             and item.target.id == "warmup_steps"]
    assert declared == ["train/schedule.py:Schedule"]


def test_compare_budgets_train_as_before():
    assert {task: _four(setup.schedule) for task, setup in QUICK.tasks.items()} == {
        "lm": (300, 32, 3e-3, 30), "mqar": (600, 64, 3e-3, 200), "listops": (1200, 64, 3e-3, 100)}
    assert {task: _four(setup.schedule) for task, setup in FULL.tasks.items()} == {
        "lm": (1500, 32, 3e-3, 100), "mqar": (3000, 64, 3e-3, 200), "listops": (2000, 64, 3e-3, 200)}
    every = [setup.schedule for budget in (QUICK, FULL) for setup in budget.tasks.values()]
    assert {(s.min_lr_ratio, s.grad_clip) for s in every} == {(0.1, 1.0)}  # the task loop's, as before


def test_long_curricula_train_as_before():
    warmup = [(600, 64, 1e-3, 200), (150, 32, 3e-3, 30)]
    expected = {
        "mqar": (warmup + [(200, 16, 1e-3, 20), (100, 8, 2e-3, 10), (150, 4, 1e-3, 10)], (150, 4, 1e-3, 10)),
        "mqar_512": (warmup + [(200, 16, 1e-3, 20)], (200, 16, 1e-3, 20)),
        "lm": ([(250, 32, 3e-3, 25), (60, 8, 1e-3, 6)], (60, 8, 1e-3, 6)),
        "code_lm": ([(1500, 32, 3e-3, 100), (3000, 8, 2e-3, 50), (3000, 2, 1e-3, 50)], (3000, 2, 1e-3, 50)),
    }
    # the last stage trains on the task itself, as `schedule` says
    assert {task: ([_four(stage.schedule) for stage in setup.stages], _four(setup.schedule))
            for task, setup in LONG.tasks.items()} == expected
    assert {(s.schedule.min_lr_ratio, s.schedule.grad_clip) for t in LONG.tasks.values() for s in t.stages} \
        == {(0.1, 1.0)}


def test_defaults_are_those_of_before():
    task = TaskTrainConfig().schedule
    assert _four(task) + (task.min_lr_ratio, task.grad_clip) == (1000, 32, 1e-3, 50, 0.1, 1.0)
    train = TrainConfig().schedule
    assert _four(train) + (train.min_lr_ratio, train.grad_clip) == (600, 32, 3e-3, 100, 0.1, 1.0)
    assert _four(RecallRun("copying", {}).schedule) == (600, 32, 3e-3, 60)


def test_train_files_and_overrides_keep_their_flat_keys(tmp_path):
    config = load_config(CONFIGS / "tiny.yaml", ["--train.warmup_steps=7", "--lr", "1e-2", "--train.steps=9",
                                                 "--grad_clip", "0.5", "--batch_size", "4"])
    assert _four(config.train.schedule) == (9, 4, 1e-2, 7) and config.train.schedule.grad_clip == 0.5
    assert config.train.eval_every == 10 and config.train.schedule.min_lr_ratio == 0.1
    flat = config.to_dict()["train"]
    assert "schedule" not in flat and (flat["warmup_steps"], flat["steps"], flat["lr"]) == (7, 9, 1e-2)
    assert RunConfig.from_dict(config.to_dict()) == config
    assert _four(load_config(CONFIGS / "char-lm.yaml").train.schedule) == (600, 32, 3e-3, 100)
    with pytest.raises(ValueError, match=r"unknown train config key\(s\) \['schedule'\]"):
        RunConfig.from_dict({"train": {"schedule": {"steps": 3}}})
    with pytest.raises(ValueError, match="train.warmup_steps must be >= 0; got -1"):
        load_config(None, ["--warmup_steps", "-1"])
