"""The training driver (train/driver.py) both `routeformer train` and task runs go through: a run
stopped at a step and restored from its `capture` into a fresh driver ends with the weights of one
never stopped; `reseed` decides whether the driver seeds torch; an fp16-style scaler's state travels
in the capture and only then."""

import torch
from torch import nn

from routeformer.train.driver import Driver
from routeformer.train.schedule import Schedule

SCHEDULE = Schedule(steps=6, batch_size=4, lr=1e-2, warmup_steps=2)


class Noisy(nn.Module):
    """A regression model whose forward draws from torch's RNG (as dropout does)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def forward(self, inputs, labels):
        noise = 0.01 * torch.randn_like(inputs)
        loss = ((self.layer(inputs + noise).squeeze(-1) - labels) ** 2).mean()
        return type("Output", (), {"total_loss": loss, "loss": loss, "aux_loss": loss * 0})()


def _driver(model: nn.Module, steps: int = SCHEDULE.steps, **options) -> Driver:
    schedule = Schedule(steps, SCHEDULE.batch_size, SCHEDULE.lr, SCHEDULE.warmup_steps)
    return Driver(model, schedule=schedule, seed=3, weight_decay=0.1, betas=(0.9, 0.99), max_nonfinite=2,
                  device=torch.device("cpu"), **options)


def _train(driver: Driver) -> None:
    def batch():
        inputs = torch.randn(SCHEDULE.batch_size, 3, generator=driver.generator)
        return inputs, inputs.sum(-1), {}

    driver.train(batch, lambda trained, inputs, labels, extra: trained(inputs, labels))


def _fresh_model() -> nn.Module:
    torch.manual_seed(0)
    return Noisy()


def test_a_run_restored_from_its_capture_ends_as_one_never_stopped():
    whole = _driver(_fresh_model())
    _train(whole)
    first = _driver(_fresh_model(), steps=3)
    _train(first)
    saved = first.capture(first.step)
    second = _driver(_fresh_model())
    assert second.restore(saved) is None and second.step == 3
    _train(second)
    assert second.step == whole.step == SCHEDULE.steps
    for key, value in whole.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[key], value), key


def test_the_driver_seeds_torch_whatever_its_state_before():
    torch.manual_seed(3)  # the driver's seed
    seeded = torch.rand(1)
    for before in (11, 12):
        torch.manual_seed(before)
        _driver(nn.Linear(3, 1))
        assert torch.equal(torch.rand(1), seeded)


def test_the_capture_holds_a_scaler_state_only_with_a_scaler():
    assert "scaler" not in _driver(nn.Linear(3, 1)).capture(0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert _driver(nn.Linear(3, 1), scaler=scaler).capture(0)["scaler"] == scaler.state_dict()


def test_a_restored_optimizer_takes_the_new_runs_weight_decay_and_betas():
    saved = _driver(nn.Linear(3, 1)).capture(0)
    restored = Driver(nn.Linear(3, 1), schedule=SCHEDULE, seed=3, weight_decay=0.5, betas=(0.8, 0.9),
                      max_nonfinite=2, device=torch.device("cpu"))
    restored.restore(saved)
    decay, no_decay = restored.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.5, 0.0)
    assert decay["betas"] == no_decay["betas"] == (0.8, 0.9)
