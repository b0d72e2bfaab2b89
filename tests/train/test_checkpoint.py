"""Checkpoints that cannot rot and never run code: checksum, atomic writes, the last K kept, corrupt
files reported, no pickle (safetensors + JSON), older files through the weights_only unpickler."""

import hashlib
import io
import json
import os
import struct

import pytest
import torch

from routeformer.train.checkpoint import (
    CheckpointError,
    UnsafeCheckpointError,
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
    assert (tmp_path / "a.pt").read_bytes().startswith(b"ROUTEFORMER-CHECKPOINT 2 sha256=")
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

    monkeypatch.setattr(os, "fsync", full_disk)
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


def test_a_stem_names_a_rotation_of_its_own_beside_the_others(tmp_path):
    """Task runs rotate `<key>.train<n>.pt` as run directories rotate checkpoint.pt; names that only
    start alike (train1 / train10) or hold glob characters stay apart."""
    for step in range(1, 5):
        save_rotating(tmp_path, state(step), keep=3, stem="r[0].train1")
        save_rotating(tmp_path, state(10 + step), keep=2, stem="r[0].train10")
        save_rotating(tmp_path, state(20 + step), keep=2)
    assert [p.name for p in checkpoint_files(tmp_path, "r[0].train1")] == [
        "r[0].train1.pt", "r[0].train1.1.pt", "r[0].train1.2.pt"]
    assert [load_checkpoint(p)["step"] for p in checkpoint_files(tmp_path, "r[0].train1")] == [4, 3, 2]
    assert [load_checkpoint(p)["step"] for p in checkpoint_files(tmp_path, "r[0].train10")] == [14, 13]
    assert [load_checkpoint(p)["step"] for p in checkpoint_files(tmp_path)] == [24, 23]
    assert len(list(tmp_path.iterdir())) == 7  # no temporary file left


@pytest.mark.parametrize("keep", [0, -1, True, 2.0])
def test_keep_below_one_is_refused_before_anything_is_written(tmp_path, keep):
    with pytest.raises(ValueError, match=f"keep must be an integer >= 1 .*got {keep!r}"):
        save_rotating(tmp_path, state(1), keep=keep)
    assert list(tmp_path.iterdir()) == []


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


RAN: list[str] = []


def record_that_code_ran(what: str) -> None:
    RAN.append(what)


class RunsCode:
    """Unpickling this object would run code (here: only record that it did)."""

    def __reduce__(self):
        return (record_that_code_ran, ("unpickled",))


def full_state() -> dict:
    """What a training checkpoint holds: tensors of several dtypes, shared (tied) tensors, optimizer
    state keyed by integer ids, tuples, nested dicts, floats including inf, None."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.99))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    weights = model.state_dict()
    return {"step": 7, "model": {**weights, "tied": weights["weight"]}, "optimizer": optimizer.state_dict(),
            "rng": {"data": torch.Generator().manual_seed(3).get_state(), "torch": torch.get_rng_state()},
            "config": {"train": {"lr": 3e-3, "final_eval_tokens": None, "log_stats": ["kl"]}},
            "scaler": {"scale": float("inf"), "__odd": 1}, "flags": torch.tensor([True, False]),
            "half": torch.arange(4, dtype=torch.bfloat16), "vocab": {"tokens": ["<unk>", "a"]}}


def assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_every_kind_of_value_a_training_state_holds_round_trips_exactly(tmp_path):
    saved = full_state()
    save_checkpoint(tmp_path / "a.pt", saved)
    loaded = load_checkpoint(tmp_path / "a.pt")
    assert_same(saved, loaded)
    assert isinstance(next(iter(loaded["optimizer"]["state"])), int)  # parameter ids stay integers
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    # The optimizer state loads back into a fresh optimizer and steps identically.
    model = torch.nn.Linear(3, 2)
    model.load_state_dict({k: v for k, v in loaded["model"].items() if k != "tied"})
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(loaded["optimizer"])


def test_the_payload_is_a_plain_safetensors_file_with_json_metadata(tmp_path):
    from safetensors.torch import load

    save_checkpoint(tmp_path / "a.pt", full_state())
    payload = (tmp_path / "a.pt").read_bytes().split(b"\n", 1)[1]
    (length,) = struct.unpack("<Q", payload[:8])
    metadata = json.loads(payload[8:8 + length])["__metadata__"]
    assert metadata["format"] == "routeformer-checkpoint-2"
    assert json.loads(metadata["routeformer.state"])["step"] == 7
    tensors = load(payload)
    # weight, bias (the tied copy stored once), 3 AdamW tensors per parameter, 2 RNG states, 2 more
    assert len(tensors) == 12


def test_objects_that_are_not_plain_values_are_refused_when_saving(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint state '.history' holds a RunsCode"):
        save_checkpoint(tmp_path / "a.pt", {"step": 1, "history": RunsCode()})
    assert not (tmp_path / "a.pt").exists()


def write_pickled(path, state, *, header: bool) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    prefix = b"ROUTEFORMER-CHECKPOINT 1 sha256=" + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    path.write_bytes((prefix if header else b"") + payload)


@pytest.mark.parametrize("header", [True, False], ids=["version-1", "bare-zip"])
def test_older_pickled_checkpoints_load_through_the_weights_only_unpickler(tmp_path, header):
    saved = full_state()
    write_pickled(tmp_path / "old.pt", saved, header=header)
    assert_same(load_checkpoint(tmp_path / "old.pt"), saved)


@pytest.mark.parametrize("header", [True, False], ids=["version-1", "bare-zip"])
def test_an_old_checkpoint_holding_code_is_refused_in_one_line_without_running_it(tmp_path, header):
    RAN.clear()
    write_pickled(tmp_path / "checkpoint.pt", {"step": 1, "history": RunsCode()}, header=header)
    with pytest.raises(UnsafeCheckpointError) as caught:
        load_checkpoint(tmp_path / "checkpoint.pt")
    message = str(caught.value)
    assert "\n" not in message and "not unpickled" in message and "checkpoint.pt" in message
    assert RAN == []
    with pytest.raises(UnsafeCheckpointError):  # resuming refuses it too, and leaves the file in place
        latest_checkpoint(tmp_path)
    assert (tmp_path / "checkpoint.pt").exists()
