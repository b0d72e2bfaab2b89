"""Bounded waits for tests that start processes (the suite can never hang). Each helper
fails the test with a message naming what it waited for, after stopping what it started — a
subprocess together with its own children (torchrun's ranks), or every spawned rank."""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import pytest
import torch.multiprocessing as mp


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the process and every child it started
    except (AttributeError, ProcessLookupError, PermissionError):
        process.kill()


def run_bounded(command: Sequence[str], *, timeout: float, what: str,
                **options) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, **options), in a session of its own:
    past `timeout` seconds the whole process group is killed (a child's children would otherwise
    live on, asleep, holding the output pipes) and the test fails naming `what`."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **options)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(no output: the pipes stayed open after the kill)"
        pytest.fail(f"{what}: still running after {timeout:g} s; killed with its children "
                    f"({' '.join(map(str, command))[:300]}). Its stderr ends:\n{(stderr or '')[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def spawn_ranks(function: Callable, args: tuple, nprocs: int, *, timeout: float, what: str) -> None:
    """torch.multiprocessing.spawn(function, args, nprocs) that waits at most `timeout` seconds:
    a rank that raises fails the test with its traceback (as spawn does); ranks still running at
    the deadline are terminated, then killed, and the test fails naming `what` and them."""
    context = mp.start_processes(function, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() < deadline:
            continue  # one rank finished; wait for the others
        alive = [(rank, process.pid) for rank, process in enumerate(context.processes) if process.is_alive()]
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
        pytest.fail(f"{what}: {len(alive)} of {nprocs} spawned ranks still running after {timeout:g} s "
                    f"(rank, pid: {alive}); terminated")


def rank_watchdog(seconds: float) -> None:
    """Called first thing in a spawned rank: past `seconds` the rank prints every thread's stack to
    stderr (the test's captured output) and exits with status 1, so a rank stuck anywhere — a
    collective, a store, interpreter exit — fails the test with where it was stuck."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
