"""DistributedDataParallel on CPU (gloo): 2 processes match 1 with the same global batch, and a run
interrupted on 2 processes resumes on 1."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from routeformer.train import load_config, train
from routeformer.train.checkpoint import load_checkpoint
from routeformer.train.distributed import DistributedContext, check_shardable, local_shard

# No dropout: the ranks draw their own dropout masks, which a single process would not.
TINY = ["--model.dim", "32", "--model.depth", "2", "--model.heads", "2", "--seq_len", "32",
        "--batch_size", "8", "--steps", "6", "--warmup_steps", "2", "--eval_every", "3",
        "--eval_tokens", "1024", "--log_every", "1", "--checkpoint_every", "3", "--model.dropout", "0",
        "--final_eval_tokens", "4096"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def final_record(out_dir):
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return lines, next(line for line in lines if line.get("final"))


def assert_close_models(a, b):
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], atol=2e-5, rtol=1e-4, msg=name)


def test_sharding_and_its_errors():
    batch = torch.arange(8)[:, None]
    shards = [local_shard(batch, DistributedContext(rank, 4)) for rank in range(4)]
    assert torch.equal(torch.cat(shards), batch)
    with pytest.raises(ValueError, match=r"train.batch_size \(6\) is the global batch .* processes \(4\)"):
        check_shardable(6, DistributedContext(0, 4))


def test_torchrun_two_processes_match_one(tmp_path):
    single = tmp_path / "single"
    train(load_config(None, TINY + ["--out_dir", str(single)]), quiet=True)
    pair = tmp_path / "pair"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "routeformer.cli", "train", *TINY, "--out_dir", str(pair)]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "2 processes" in finished.stderr
    assert_close_models(load_checkpoint(pair)["model"], load_checkpoint(single)["model"])
    single_lines, single_final = final_record(single)
    pair_lines, pair_final = final_record(pair)
    assert len(pair_lines) == len(single_lines)  # rank 0 alone logged
    assert pair_final["val_bpc"] == pytest.approx(single_final["val_bpc"], abs=1e-4)
    # The logged loss is the mean over both ranks, i.e. the single process's loss on the same batch.
    assert pair_lines[0]["loss"] == pytest.approx(single_lines[0]["loss"], abs=1e-5)


def _worker(rank: int, world_size: int, port: int, out_dir: str, stop_step: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)

    def stop(step):
        if step == stop_step:
            raise KeyboardInterrupt  # the interrupt path: rank 0 checkpoints the last step

    try:
        train(load_config(None, TINY + ["--out_dir", out_dir]), after_step=stop, quiet=True)
    except KeyboardInterrupt:
        pass


def test_run_interrupted_on_two_processes_resumes_on_one(tmp_path):
    split = tmp_path / "split"
    mp.spawn(_worker, args=(2, free_port(), str(split), 4), nprocs=2, join=True)
    assert load_checkpoint(split)["step"] == 4
    train(load_config(None, TINY + ["--out_dir", str(split)]), quiet=True)  # one process: steps 5-6
    whole = tmp_path / "whole"
    train(load_config(None, TINY + ["--out_dir", str(whole)]), quiet=True)
    assert load_checkpoint(split)["step"] == 6
    assert_close_models(load_checkpoint(split)["model"], load_checkpoint(whole)["model"])
