"""DistributedDataParallel on CPU (gloo) for an LM run (`routeformer train`, its task-lm run): 2
processes match 1 with the same global batch, a run interrupted on 2 processes resumes on 1, a
2-process `meta` run (routing samples and dropout drawn per rank) resumes bit-identically, and the
unused-parameter search is on only where needed."""

import json
import os
import socket
import sys

import pytest
import torch

from routeformer.attention import attention_class, list_attentions
from routeformer.train import load_config, train
from routeformer.train.checkpoint import load_checkpoint
from routeformer.train.distributed import (
    DistributedContext,
    check_shardable,
    local_shard,
    needs_unused_parameter_search,
)
from tests.bounded import rank_watchdog, run_bounded, spawn_ranks
from tests.train.test_training import stopping_batches

# Every wait here is bounded: a rank waits at most RANK_TIMEOUT_S for the others (gloo
# then raises, naming the collective), and a test at most SPAWN_TIMEOUT_S for its ranks.
RANK_TIMEOUT_S = "60"
SPAWN_TIMEOUT_S = 280
RANK_WATCHDOG_S = 240  # a rank stuck past this prints its stacks and exits (before SPAWN_TIMEOUT_S)

# No dropout: the ranks draw their own dropout masks, which a single process would not.
TINY = ["--model.dim", "32", "--model.depth", "2", "--model.heads", "2", "--seq_len", "32",
        "--batch_size", "8", "--steps", "6", "--warmup_steps", "2", "--eval_every", "3",
        "--eval_tokens", "1024", "--log_every", "1", "--checkpoint_every", "3", "--model.dropout", "0",
        "--final_eval_tokens", "4096"]


TRAINING = "record.train0.pt"  # an LM run directory's newest training checkpoint


def stop_in_batch(call: int) -> None:
    """Raise KeyboardInterrupt while the LM task draws its `call`-th training batch (in this process,
    a spawned rank: no monkeypatch to undo)."""
    from routeformer.tasks.lm import CharLM

    CharLM.training_batch = stopping_batches(call, KeyboardInterrupt())


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
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "ROUTEFORMER_DIST_TIMEOUT_S": RANK_TIMEOUT_S}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "routeformer.cli", "train", *TINY, "--out_dir", str(pair)]
    finished = run_bounded(command, env=environment, timeout=SPAWN_TIMEOUT_S, what="torchrun with 2 ranks")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert len(finished.stdout.strip().splitlines()) == 1  # rank 0 alone printed the summary
    assert_close_models(load_checkpoint(pair)["model"], load_checkpoint(single)["model"])
    single_lines, single_final = final_record(single)
    pair_lines, pair_final = final_record(pair)
    assert len(pair_lines) == len(single_lines)  # rank 0 alone logged
    bits = "test_bits_per_char"
    assert pair_final[bits] == pytest.approx(single_final[bits], abs=1e-4)
    # The logged loss is the mean over both ranks, i.e. the single process's loss on the same batch.
    assert pair_lines[0]["loss"] == pytest.approx(single_lines[0]["loss"], abs=1e-5)


def _worker(rank: int, world_size: int, port: int, out_dir: str, stop_step: int) -> None:
    rank_watchdog(RANK_WATCHDOG_S)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), ROUTEFORMER_DIST_TIMEOUT_S=RANK_TIMEOUT_S)
    torch.set_num_threads(1)
    stop_in_batch(stop_step)  # the interrupt path: every rank stops, rank 0's checkpoints stay
    try:
        train(load_config(None, TINY + ["--out_dir", out_dir]), quiet=True)
    except KeyboardInterrupt:
        pass


def test_run_interrupted_on_two_processes_resumes_on_one(tmp_path):
    split = tmp_path / "split"
    spawn_ranks(_worker, (2, free_port(), str(split), 5), 2, timeout=SPAWN_TIMEOUT_S,
                what="2 ranks training until the interrupt in step 5")
    assert load_checkpoint(split / TRAINING)["step"] == 3  # the evaluation after step 3
    train(load_config(None, TINY + ["--out_dir", str(split)]), quiet=True)  # one process: steps 4-6
    whole = tmp_path / "whole"
    train(load_config(None, TINY + ["--out_dir", str(whole)]), quiet=True)
    assert load_checkpoint(split)["step"] == 6
    assert_close_models(load_checkpoint(split)["model"], load_checkpoint(whole)["model"])


# meta samples its routing in training (sample_routing) and dropout is on: every rank draws randomness.
META = TINY + ["--model.attention", "meta", "--model.attention_options", "{meta: {window: 8}}",
               "--model.dropout", "0.1"]


def _resume_worker(rank: int, world_size: int, ports: list[int], root: str) -> None:
    """On each of 2 ranks: an uninterrupted run, then the same run interrupted in step 5 (its newest
    checkpoint holds step 3) and resumed in the same processes (each run on a fresh port: a process
    group set up again on the port of a destroyed one can wait forever)."""
    rank_watchdog(RANK_WATCHDOG_S)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      ROUTEFORMER_DIST_TIMEOUT_S=RANK_TIMEOUT_S)
    torch.set_num_threads(1)
    train(load_config(None, META + ["--out_dir", f"{root}/whole"]), quiet=True)
    os.environ["MASTER_PORT"] = str(ports[1])
    from routeformer.tasks.lm import CharLM

    draw = CharLM.training_batch
    stop_in_batch(5)
    try:
        train(load_config(None, META + ["--out_dir", f"{root}/split"]), quiet=True)
    except KeyboardInterrupt:
        pass
    CharLM.training_batch = draw
    os.environ["MASTER_PORT"] = str(ports[2])
    train(load_config(None, META + ["--out_dir", f"{root}/split"]), quiet=True)


def test_a_two_process_meta_run_resumes_bit_identically(tmp_path):
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:  # three distinct free ports
        for sock in (a, b, c):
            sock.bind(("127.0.0.1", 0))
        ports = [sock.getsockname()[1] for sock in (a, b, c)]
    spawn_ranks(_resume_worker, (2, ports, str(tmp_path)), 2, timeout=SPAWN_TIMEOUT_S,
                what="2 ranks running a meta run whole, interrupted and resumed")
    split, whole = (load_checkpoint(tmp_path / run / TRAINING) for run in ("split", "whole"))
    assert split["step"] == whole["step"] == 6 and len(whole["rng"]["ranks"]) == 2
    assert not torch.equal(*whole["rng"]["ranks"])  # the ranks' generators differ
    for name, value in whole["model"].items():
        assert torch.equal(value, split["model"][name]), name
    generators = lambda state: [state["rng"]["data"], *state["rng"]["ranks"]]  # noqa: E731
    for a, b in zip(generators(whole), generators(split), strict=True):
        assert torch.equal(a, b)

    def losses(run):  # timings differ between runs; the values must not
        records = final_record(tmp_path / run)[0]
        return [(r["step"], r.get("loss"), r.get("val_bits_per_char")) for r in records
                if "loss" in r or "val_bits_per_char" in r]

    assert losses("split") == losses("whole")


def test_the_unused_parameter_search_is_on_only_where_a_parameter_can_go_unused():
    assert not needs_unused_parameter_search(["full", "local", "linear"])
    assert needs_unused_parameter_search(["full", "meta"])
    assert needs_unused_parameter_search(["a-new-mechanism"])  # unknown: the safe setting
    assert needs_unused_parameter_search(["local", "topk"])  # one layer that can leave a parameter unused
    routed = ("meta", "topk", "mita", "meta_tokens")  # data-dependent experts, routers, meta-tokens
    assert not any(attention_class(name).every_parameter_used for name in routed)


@pytest.mark.parametrize("mechanism", sorted(name for name in list_attentions()
                                              if attention_class(name).every_parameter_used))
def test_the_mechanisms_said_to_use_every_parameter_do(mechanism):
    from routeformer.models.config import ModelConfig
    from routeformer.models.heads import CausalLM

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=20, dim=16, depth=1, heads=2, attention=mechanism, max_seq_len=40)
    model = CausalLM(config)
    for length in (1, 7, 33):
        model.zero_grad(set_to_none=True)
        tokens = torch.randint(0, 20, (2, length))
        model(tokens, tokens).total_loss.backward()
        unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert unused == [], (length, unused)
