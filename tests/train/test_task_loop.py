"""The synthetic-task loop resumes an interrupted run exactly, inside `resumable_training`."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from routeformer.runner.jobs import cached_run
from routeformer.train.checkpoint import load_checkpoint
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import (
    TaskTrainConfig,
    evaluations_to,
    resumable_training,
    train_task,
    training_checkpoints,
)


class _Interrupted(RuntimeError):
    pass


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Dropout draws from torch's global RNG, so an exact resume must restore it too.
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))


def _batches(fail_at_call: int | None = None):
    calls = []

    def make_batch(batch_size, generator):
        calls.append(None)
        if fail_at_call is not None and len(calls) == fail_at_call:
            raise _Interrupted("killed")
        inputs = torch.randn(batch_size, 4, generator=generator)
        return inputs, inputs.sum(dim=1, keepdim=True).sin()

    return make_batch, calls


def _forward(model, inputs, labels):
    loss = (model(inputs) - labels).pow(2).mean()
    return SimpleNamespace(total_loss=loss, loss=loss, aux_loss=torch.zeros(()))


def _evaluate(model):
    # Draws from the global RNG on purpose: the checkpoint is written after evaluating.
    probe = torch.randn(8, 4)
    with torch.no_grad():
        return {"probe": float(model(probe).sum())}


CONFIG = TaskTrainConfig(Schedule(steps=7, batch_size=8, lr=1e-2, warmup_steps=2), eval_every=2, seed=3)
STEPS = CONFIG.schedule.steps


def _train(directory, key, fail_at_call=None, config=CONFIG):
    model = _model()
    make_batch, calls = _batches(fail_at_call)
    with resumable_training(directory, key):
        history = train_task(model, make_batch, _evaluate, config, forward=_forward)
    return model, history, calls


def test_an_interrupted_run_resumes_to_the_same_weights_and_history(tmp_path):
    reference, reference_history, _ = _train(tmp_path / "straight", "run")
    with pytest.raises(_Interrupted):
        _train(tmp_path / "killed", "run", fail_at_call=6)  # dies in step 6, after the step-4 evaluation
    saved = training_checkpoints(tmp_path / "killed", "run")
    assert [path.name for path in saved] == ["run.train0.1.pt", "run.train0.pt"]  # after steps 2 and 4
    resumed, history, calls = _train(tmp_path / "killed", "run")
    assert len(calls) == STEPS - 4, "the resumed run must start after the last evaluation"
    for ours, theirs in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert history.evals == reference_history.evals
    assert [record["step"] for record in history.evals] == [2, 4, 6, 7]
    # A finished run resumes as finished: its final weights, no step taken.
    again, _, calls = _train(tmp_path / "killed", "run")
    assert calls == []
    torch.testing.assert_close(again[0].weight, reference[0].weight, rtol=0, atol=0)


def test_without_resumable_training_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_batch, _ = _batches()
    train_task(_model(), make_batch, _evaluate, CONFIG, forward=_forward)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_of_another_config_is_refused(tmp_path):
    with pytest.raises(_Interrupted):
        _train(tmp_path, "run", fail_at_call=4)
    changed = replace(CONFIG, schedule=replace(CONFIG.schedule, lr=5e-3))
    with pytest.raises(ValueError, match="another training config"):
        _train(tmp_path, "run", config=changed)


def test_cached_run_resumes_its_training_and_then_deletes_the_checkpoints(tmp_path):
    def compute(fail_at_call=None):
        model = _model()
        make_batch, calls = _batches(fail_at_call)
        first = train_task(model, make_batch, _evaluate, CONFIG, forward=_forward)
        second = train_task(_model(), _batches()[0], _evaluate, CONFIG, forward=_forward)
        return {"first": first.final, "second": second.final, "steps_run": len(calls)}

    with pytest.raises(_Interrupted):
        cached_run(tmp_path, "cell", lambda: compute(fail_at_call=5))
    assert len(training_checkpoints(tmp_path / "runs", "cell")) == 2  # the newest and the one before
    record = cached_run(tmp_path, "cell", compute)
    assert record["steps_run"] == STEPS - 4
    assert training_checkpoints(tmp_path / "runs", "cell") == []
    straight = cached_run(tmp_path / "other", "cell", compute)
    assert straight["first"] == record["first"] and straight["second"] == record["second"]


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-50])


def test_a_corrupt_checkpoint_is_reported_and_the_one_before_resumed(tmp_path, capsys):
    reference, reference_history, _ = _train(tmp_path / "straight", "run")
    with pytest.raises(_Interrupted):
        _train(tmp_path / "killed", "run", fail_at_call=6)  # checkpointed after steps 2 and 4
    _truncate(tmp_path / "killed/run.train0.pt")
    resumed, history, calls = _train(tmp_path / "killed", "run")
    error = capsys.readouterr().err
    assert "run.train0.pt' is corrupt or truncated" in error and "resuming from run.train0.1.pt" in error
    assert len(calls) == STEPS - 2 and (tmp_path / "killed/run.train0.pt.corrupt").exists()
    assert history.evals == reference_history.evals
    for ours, theirs in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_with_both_checkpoints_corrupt_the_call_starts_over(tmp_path, capsys):
    reference, reference_history, _ = _train(tmp_path / "straight", "run")
    with pytest.raises(_Interrupted):
        _train(tmp_path / "killed", "run", fail_at_call=6)
    for saved in training_checkpoints(tmp_path / "killed", "run"):
        _truncate(saved)
    resumed, history, calls = _train(tmp_path / "killed", "run")
    assert "moved aside, this run starts over" in capsys.readouterr().err
    assert len(calls) == STEPS and history.evals == reference_history.evals


def test_a_crash_while_a_checkpoint_is_written_leaves_the_one_before(tmp_path, monkeypatch):
    """The checkpoint after step 4 fails part-way (its file never appears): the one after step 2
    is still the newest, and the run resumes from it to the weights of one never stopped."""
    from routeformer.train import checkpoint as checkpoints

    reference, reference_history, _ = _train(tmp_path / "straight", "run")
    written = []

    def crashing(path, state):
        written.append(state["step"])
        if state["step"] == 4:
            raise _Interrupted("killed while writing")
        return save(path, state)

    save = checkpoints.save_checkpoint
    monkeypatch.setattr(checkpoints, "save_checkpoint", crashing)
    with pytest.raises(_Interrupted):
        _train(tmp_path / "killed", "run")
    monkeypatch.setattr(checkpoints, "save_checkpoint", save)
    assert written == [2, 4]
    assert [path.name for path in training_checkpoints(tmp_path / "killed", "run")] == ["run.train0.pt"]
    resumed, history, calls = _train(tmp_path / "killed", "run")
    assert len(calls) == STEPS - 2 and history.evals == reference_history.evals
    for ours, theirs in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_keep_checkpoints_sets_how_many_rotate_and_a_resume_reaches_the_oldest(tmp_path, capsys):
    reference, reference_history, _ = _train(tmp_path / "straight", "run")
    three = replace(CONFIG, keep_checkpoints=3)
    with pytest.raises(_Interrupted):
        _train(tmp_path / "killed", "run", fail_at_call=7, config=three)  # checkpointed after 2, 4 and 6
    saved = training_checkpoints(tmp_path / "killed", "run")
    assert [path.name for path in saved] == ["run.train0.1.pt", "run.train0.2.pt", "run.train0.pt"]
    assert [load_checkpoint(tmp_path / "killed" / name)["step"]
            for name in ("run.train0.pt", "run.train0.1.pt", "run.train0.2.pt")] == [6, 4, 2]
    _truncate(tmp_path / "killed/run.train0.pt")
    _truncate(tmp_path / "killed/run.train0.1.pt")
    # keep_checkpoints says how the run is kept, not what it trains: a resume may change it.
    resumed, history, calls = _train(tmp_path / "killed", "run", config=replace(CONFIG, keep_checkpoints=1))
    assert "resuming from run.train0.2.pt" in capsys.readouterr().err
    assert len(calls) == STEPS - 2 and history.evals == reference_history.evals
    for ours, theirs in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert [path.name for path in training_checkpoints(tmp_path / "killed", "run")] == ["run.train0.pt"]


@pytest.mark.parametrize("keep", [0, -1, True, 2.0, "2"])
def test_keep_checkpoints_must_be_a_positive_integer(keep):
    with pytest.raises(ValueError, match=f"keep_checkpoints: a positive integer .*got {keep!r}"):
        replace(CONFIG, keep_checkpoints=keep)


def test_a_non_finite_step_is_skipped(tmp_path, capsys):
    calls = []

    def forward(model, inputs, labels):
        calls.append(None)
        output = _forward(model, inputs, labels)
        if len(calls) == 3:  # one poisoned step: its update is skipped, the run goes on
            output.total_loss = output.loss = output.loss * float("nan")
        return output

    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    heard = []
    with evaluations_to(heard.append):
        history = train_task(model, _batches()[0], _evaluate, CONFIG, forward=forward)
    assert "step 3: non-finite loss nan" in capsys.readouterr().err
    skipped = [record for record in heard if "skipped" in record]  # as the LM run logs it
    assert [record["step"] for record in skipped] == [3] and "update skipped" in skipped[0]["skipped"]
    assert set(skipped[0]) == {"step", "skipped"}
    assert len(history.evals) == 4 and all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _ctrl_c_batches(at_call: int, presses: int = 1):
    """Batches that press Ctrl-C `presses` times while drawing the batch of call `at_call`."""
    import signal

    make_batch, calls = _batches()

    def pressing(batch_size, generator):
        if len(calls) + 1 == at_call:
            for _ in range(presses):
                signal.raise_signal(signal.SIGINT)
        return make_batch(batch_size, generator)

    return pressing, calls


def _train_with(directory, make_batch):
    model = _model()
    with resumable_training(directory, "run"):
        history = train_task(model, make_batch, _evaluate, CONFIG, forward=_forward)
    return model, history


@pytest.fixture
def ctrl_c_handled(monkeypatch):
    """Python's own SIGINT handler while the test runs (an earlier test may have left another)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_saves_at_the_step_boundary_and_the_resumed_run_repeats_no_step(tmp_path, ctrl_c_handled):
    reference, reference_history, _ = _train(tmp_path / "straight", "run")
    pressing, _ = _ctrl_c_batches(at_call=5)  # inside step 5, after the step-4 evaluation
    with pytest.raises(KeyboardInterrupt):
        _train_with(tmp_path / "stopped", pressing)
    make_batch, calls = _batches()
    resumed, history = _train_with(tmp_path / "stopped", make_batch)
    assert len(calls) == STEPS - 5, "the run resumes after step 5, where Ctrl-C stopped it"
    for ours, theirs in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert history.evals == reference_history.evals


def test_a_second_ctrl_c_stops_inside_the_step_keeping_the_last_evaluation(tmp_path, ctrl_c_handled):
    from routeformer.train.interrupts import InterruptedMidStep

    pressing, _ = _ctrl_c_batches(at_call=5, presses=2)
    with pytest.raises(InterruptedMidStep):
        _train_with(tmp_path, pressing)
    make_batch, calls = _batches()
    _train_with(tmp_path, make_batch)
    assert len(calls) == STEPS - 4, "nothing saved in step 5: the run resumes after the step-4 evaluation"


def test_inside_schedule_may_change_a_resume_continues_on_the_new_schedule(tmp_path):
    from routeformer.train.task_loop import schedule_may_change

    with pytest.raises(_Interrupted):
        _train(tmp_path, "run", fail_at_call=6)  # checkpointed after steps 2 and 4
    longer = replace(CONFIG, schedule=replace(CONFIG.schedule, steps=9, lr=5e-3))
    with pytest.raises(ValueError, match="another training config"):
        _train(tmp_path, "run", config=longer)  # outside the block: refused
    with schedule_may_change():
        _, history, calls = _train(tmp_path, "run", config=longer)
        assert len(calls) == 9 - 4
        assert [record["step"] for record in history.evals] == [2, 4, 6, 8, 9]
        seeded = replace(longer, seed=CONFIG.seed + 1)  # not a schedule change: still refused
        with pytest.raises(ValueError, match="another training config"):
            _train(tmp_path, "run", config=seeded)
