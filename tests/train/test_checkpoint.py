"""Checkpoints that cannot rot: checksum, atomic writes, the last K kept, corrupt files reported."""

import io

import pytest
import torch

from routeformer.train.checkpoint import (
    CheckpointError,
    checkpoint_files,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_rotating,
)
from routeformer.train.guard import TrainingDiverged


def state(step: int, value: float = 1.0) -> dict:
    return {"step": step, "model": {"weight": torch.full((64, 64), value)}}


def damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "overwritten":  # bytes in the middle of the payload: the file still unpickles
        middle = len(data) // 2
        path.write_bytes(data[:middle] + b"\x00" * 16 + data[middle + 16:])
    else:
        path.write_bytes(data[: len(data) // 2])


def test_a_checkpoint_round_trips_with_its_checksum(tmp_path):
    save_checkpoint(tmp_path / "a.pt", state(3))
    assert (tmp_path / "a.pt").read_bytes().startswith(b"ROUTEFORMER-CHECKPOINT 1 sha256=")
    loaded = load_checkpoint(tmp_path / "a.pt")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["weight"], state(3)["model"]["weight"])
    assert list(tmp_path.iterdir()) == [tmp_path / "a.pt"]  # no temporary file left behind


@pytest.mark.parametrize("how", ["overwritten", "truncated"])
def test_a_damaged_checkpoint_is_reported_in_one_line_naming_the_file(tmp_path, how):
    path = tmp_path / "a.pt"
    save_checkpoint(path, state(3))
    damage(path, how)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert str(path) in message and "corrupt or truncated" in message and "\n" not in message


def test_a_file_that_is_no_checkpoint_and_a_missing_one_are_errors(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"hello")
    with pytest.raises(CheckpointError, match="not a routeformer checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "none.pt")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path)


def test_checkpoints_of_older_versions_still_load(tmp_path):
    buffer = io.BytesIO()
    torch.save(state(5), buffer)  # a bare torch.save zip: what routeformer wrote before checksums
    (tmp_path / "old.pt").write_bytes(buffer.getvalue())
    assert load_checkpoint(tmp_path / "old.pt")["step"] == 5


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "a.pt"
    save_checkpoint(path, state(1))

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        save_checkpoint(path, state(2))
    assert load_checkpoint(path)["step"] == 1


def test_non_finite_weights_are_never_written(tmp_path):
    with pytest.raises(TrainingDiverged, match="weight 'weight' holds non-finite values"):
        save_checkpoint(tmp_path / "a.pt", state(1, float("nan")))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_newest_k_checkpoints_are_kept(tmp_path, keep):
    for step in range(1, 6):
        save_rotating(tmp_path, state(step), keep=keep)
    files = checkpoint_files(tmp_path)
    assert [path.name for path in files] == ["checkpoint.pt"] + [f"checkpoint.{i}.pt" for i in range(1, keep)]
    assert [load_checkpoint(path)["step"] for path in files] == list(range(5, 5 - keep, -1))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)


def test_the_newest_intact_checkpoint_is_found_and_the_corrupt_one_moved_aside(tmp_path):
    for step in (5, 10):
        save_rotating(tmp_path, state(step), keep=2)
    damage(tmp_path / "checkpoint.pt", "truncated")
    reports = []
    path, loaded = latest_checkpoint(tmp_path, report=reports.append)
    assert path.name == "checkpoint.1.pt" and loaded["step"] == 5
    assert len(reports) == 1 and "checkpoint.pt' is corrupt" in reports[0] and "moved aside" in reports[0]
    assert (tmp_path / "checkpoint.pt.corrupt").exists()
    # The next save fills the newest slot and keeps the intact older one.
    save_rotating(tmp_path, state(15), keep=2)
    assert [load_checkpoint(p)["step"] for p in checkpoint_files(tmp_path)] == [15, 5]


def test_no_intact_checkpoint_is_an_error(tmp_path):
    for step in (5, 10):
        save_rotating(tmp_path, state(step), keep=2)
    for path in checkpoint_files(tmp_path):
        damage(path, "overwritten")
    reports = []
    with pytest.raises(CheckpointError, match="no intact checkpoint in .*all 2 corrupt.*--fresh"):
        latest_checkpoint(tmp_path, report=reports.append, quarantine=False)
    assert len(reports) == 2 and len(checkpoint_files(tmp_path)) == 2  # reading moved nothing
