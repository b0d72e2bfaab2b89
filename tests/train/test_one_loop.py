"""One training loop: `train.steps.run_steps` is the only code in the package that steps an
optimizer, and `train.optim` the only code that builds one."""

import ast
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import routeformer
from routeformer.train.guard import NonFiniteGuard
from routeformer.train.optim import build_optimizer
from routeformer.train.schedule import Schedule
from routeformer.train.steps import StepState, run_steps

SOURCE = Path(routeformer.__file__).parent


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node.func, ast.unparse(node.func)


def test_only_the_one_loop_steps_an_optimizer_and_only_optim_builds_one():
    stepping, building = [], []
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE).as_posix()
        for func, text in _calls(path):
            if func.attr == "step" and ("optim" in text or "scaler" in text):
                stepping.append(relative)
            if text.startswith("torch.optim.") and text.split(".")[2][:1].isupper():
                building.append(relative)
    assert set(stepping) == {"train/steps.py"}
    assert set(building) == {"train/optim.py"}


def test_run_steps_skips_a_non_finite_update_and_reports_every_step():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = build_optimizer(model, lr=0.1, weight_decay=0.0)
    batches = iter([torch.ones(2, 3), torch.full((2, 3), float("nan")), torch.ones(2, 3)])
    updated, ended = [], []

    def forward(inputs, labels, extra):
        loss = model(inputs).square().mean()
        return SimpleNamespace(total_loss=loss)

    state = StepState(0)
    run_steps(model, optimizer, Schedule(steps=3, batch_size=2, lr=0.1, warmup_steps=1),
              NonFiniteGuard(5), state, lambda: (next(batches), None, {}), forward,
              on_update=lambda result: updated.append(result.step),
              on_step_end=lambda result: ended.append(result.step))
    assert state.step == 3 and state.at_boundary
    assert updated == [1, 3] and ended == [1, 2, 3]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
