"""`routeformer train --task` on 2 gloo processes (DistributedDataParallel, the global batch split
over the ranks): both ranks end with the same weights, which match one process trained on the
same global batch (its logged losses: the mean over the ranks); rank 0 alone writes the run
directory and prints, and `routeformer eval` reads it. A 2-process `meta` run (routing samples
drawn per rank) interrupted after an evaluation resumes bit-identically to one that never stopped.
A global batch the processes cannot split is refused."""

import contextlib
import io
import json
import os
import socket
import sys

import pytest
import torch

from routeformer.cli import main
from routeformer.cli.parser import build_task_train_parser
from routeformer.cli.task_train import check_global_batch, task_run_job
from routeformer.train.checkpoint import load_checkpoint
from routeformer.train.progress import read_records
from tests.bounded import rank_watchdog, spawn_ranks

RANK_TIMEOUT_S = "60"  # a rank waits at most this long for the other (gloo then raises)
SPAWN_TIMEOUT_S = 240
RANK_WATCHDOG_S = 200

# 3 steps, each evaluated and logged; a global batch of 8 (4 per rank); a tiny backbone.
RUN = ["train", "--task", "mqar", "--steps", "3", "--evals", "3", "--batch-size", "8", "--seed", "2",
       "--model.dim", "16", "--model.depth", "1", "--model.heads", "2", "--log-every", "1"]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _join_group(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), ROUTEFORMER_DIST_TIMEOUT_S=RANK_TIMEOUT_S)


def _record_writes(root: str) -> list[str]:
    """The paths under `root` this process opens for writing, renames, removes or creates (an
    audit hook: every Python-level file write, the checkpoints' included)."""
    root, writes = os.path.realpath(root), []
    written = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def audit(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if not (isinstance(flags, int) and flags & written) and not (mode and set(mode) & set("wax+")):
                return
            paths = [path]
        elif event in ("os.rename", "os.replace"):
            paths = [args[0], args[1]]
        elif event in ("os.remove", "os.mkdir", "os.rmdir"):
            paths = [args[0]]
        else:
            return
        for path in paths:
            if isinstance(path, (str, os.PathLike)) and os.path.realpath(os.fspath(path)).startswith(root):
                writes.append(f"{event} {os.path.relpath(os.path.realpath(os.fspath(path)), root)}")

    sys.addaudithook(audit)
    return writes


def _rank(rank: int, world_size: int, port: int, root: str) -> None:
    """One rank of `routeformer train --task mqar` into root/run; it reports its exit status, output,
    writes under root/run and final weights in root/rank<r>.json / .pt (outside the run directory)."""
    rank_watchdog(RANK_WATCHDOG_S)
    _join_group(rank, world_size, port)
    torch.set_num_threads(1)
    from routeformer.train import on_task

    trained, stages = [], on_task.train_stages

    def keeping(model, *args, **kwargs):  # the trained model of this rank, whatever it writes
        trained.append(model)
        return stages(model, *args, **kwargs)

    on_task.train_stages = keeping
    writes = _record_writes(f"{root}/run")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([*RUN, "--out", f"{root}/run"])
    report = {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(), "writes": list(writes)}
    weights = {name: value.clone() for name, value in trained[0].state_dict().items()}
    torch.save(weights, f"{root}/rank{rank}.pt")
    with open(f"{root}/rank{rank}.json", "w") as handle:
        json.dump(report, handle)


def test_two_ranks_train_one_model_that_rank_0_alone_writes(tmp_path, capsys):
    port, = free_ports(1)
    spawn_ranks(_rank, (2, port, str(tmp_path)), 2, timeout=SPAWN_TIMEOUT_S,
                what="2 ranks training mqar for 3 steps")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [report["status"] for report in reports] == [0, 0], reports[0]["stderr"][-2000:]
    weights = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name

    # Rank 0 wrote the run directory; rank 1 wrote nothing in it and printed nothing.
    run = tmp_path / "run"
    assert sorted(path.name for path in run.iterdir()) == [
        "checkpoint.pt", "config.json", "metrics.jsonl", "record.json", "record.train0.1.pt",
        "record.train0.pt"]
    written = {line.split()[-1] for line in reports[0]["writes"]}
    assert {"config.json", "record.json", "checkpoint.pt", "record.train0.pt"} <= written
    assert reports[1]["writes"] == [] and reports[1]["stdout"] == "" and reports[1]["stderr"] == ""
    summary = json.loads(reports[0]["stdout"].strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["out_dir"] == str(run)

    # One process on the same global batch trains the same model (up to the reduction order).
    single = tmp_path / "single"
    assert main([*RUN, "--out", str(single)]) == 0
    for name, value in load_checkpoint(single / "checkpoint.pt")["model"].items():
        torch.testing.assert_close(weights[0][name], value, atol=2e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(load_checkpoint(run / "checkpoint.pt")["model"][name], value,
                                   atol=2e-5, rtol=1e-4, msg=name)
    record = json.loads((run / "record.json").read_text())
    alone = json.loads((single / "record.json").read_text())
    assert [entry["step"] for entry in record["validation"]] == [1, 2, 3]
    for ours, theirs in zip(record["validation"], alone["validation"], strict=True):
        # the logged training loss is the mean over the ranks: the single process's on the same batch
        assert abs(ours["train_loss"] - theirs["train_loss"]) < 1e-4
        assert abs(ours["loss"] - theirs["loss"]) < 1e-4
    # so is each training line's: every rank joins its mean, rank 0 writes it
    lines = [[line for line in read_records(path / "metrics.jsonl") if "lr" in line]
             for path in (run, single)]
    assert [line["step"] for line in lines[0]] == [line["step"] for line in lines[1]] == [1, 2, 3]
    for ours, theirs in zip(*lines, strict=True):
        assert abs(ours["loss"] - theirs["loss"]) < 1e-4 and ours["lr"] == theirs["lr"]

    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["step"] == 3 and evaluated["split"] == "validation"
    assert evaluated["accuracy"] == record["validation"][-1]["accuracy"]
    assert abs(evaluated["loss"] - record["validation"][-1]["loss"]) < 1e-6


# meta samples its routing while training: each rank draws from its own torch generator. 4 steps,
# each evaluated (and checkpointed).
META = ["train", "--task", "mqar", "--steps", "4", "--evals", "4", "--batch-size", "8", "--seed", "2",
        "--model.dim", "16", "--model.depth", "1", "--model.heads", "2", "--mechanism", "meta",
        "--mechanism-option", "window=8"]


def _resume_rank(rank: int, world_size: int, ports: list[int], root: str) -> None:
    """On each of 2 ranks: a `meta` run whole, then the same run stopped in step 4 (after the step-3
    evaluation's checkpoint) and run again; each on a fresh port (a group set up again on the port
    of a destroyed one can wait forever)."""
    rank_watchdog(RANK_WATCHDOG_S)
    torch.set_num_threads(1)
    from routeformer.tasks.mqar import MQAR

    batch, calls = MQAR.batch, []

    def stopping(self, batch_size, generator, split="train"):
        if split == "train":
            calls.append(batch_size)
            if len(calls) == 4:
                raise KeyboardInterrupt
        return batch(self, batch_size, generator, split)

    statuses = []
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        _join_group(rank, world_size, ports[0])
        statuses.append(main([*META, "--out", f"{root}/whole"]))
        MQAR.batch = stopping
        _join_group(rank, world_size, ports[1])
        statuses.append(main([*META, "--out", f"{root}/split"]))
        MQAR.batch = batch
        _join_group(rank, world_size, ports[2])
        statuses.append(main([*META, "--out", f"{root}/split"]))
    with open(f"{root}/rank{rank}.json", "w") as handle:
        json.dump(statuses, handle)


def test_a_two_rank_meta_run_resumes_bit_identically(tmp_path):
    spawn_ranks(_resume_rank, (2, free_ports(3), str(tmp_path)), 2, timeout=SPAWN_TIMEOUT_S,
                what="2 ranks running a meta task run whole, interrupted and resumed")
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [0, 130, 0]
    whole, split = (json.loads((tmp_path / run / "record.json").read_text()) for run in ("whole", "split"))
    assert split["resumed"] == ["resumed from record.train0.pt after step 3"]
    assert split["validation"] == whole["validation"] and split["test"] == whole["test"]
    ours, theirs = (load_checkpoint(tmp_path / run / "checkpoint.pt")["model"] for run in ("split", "whole"))
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_a_global_batch_the_processes_cannot_split_is_refused_naming_the_argument():
    job = task_run_job("mqar", build_task_train_parser().parse_args(["--batch-size", "8"]))
    check_global_batch(job, 4)
    refused = r"argument --batch-size: the global batch \(8\) is split over the 3 processes"
    with pytest.raises(ValueError, match=refused):
        check_global_batch(job, 3)
