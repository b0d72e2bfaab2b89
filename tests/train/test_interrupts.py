"""Ctrl-C (a real SIGINT) at any moment of a run: the resumed run equals one never interrupted, bit
for bit (metrics.jsonl and weights), and the command ends with one line.

In-process, the SIGINT is sent by the process to itself from inside the step, deterministically:
while a batch is drawn, between backward and the update (gradients accumulated, not applied), right
after an evaluation, while a checkpoint is written, and a second Ctrl-C inside a step. One test
sends a SIGINT to a real `routeformer train` subprocess, one while it starts up."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from routeformer.tasks.lm import CharLM
from routeformer.train import on_task, task_loop, train
from routeformer.train.checkpoint import load_checkpoint
from tests.train.runs import quick_config
from tests.train.test_training import assert_same_parameters

TRAINING = "record.train0.pt"  # an LM run directory's newest training checkpoint
SPEED = ("tokens_per_s", "peak_mem_mib")  # measurements of the machine, not of the run


@pytest.fixture(autouse=True)
def python_handles_sigint():
    """Python's own SIGINT handler for every test here, whoever started pytest: a shell starts a
    background job (`cmd &`, nohup) with SIGINT ignored, and a process that inherits the ignoring
    keeps it (as it should) — then no Ctrl-C could reach the runs these tests interrupt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def records(run):
    return [{k: v for k, v in json.loads(line).items() if k not in SPEED}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The 12-step run (dropout 0.1, evaluations at 6 and 12, checkpoints at 5, 6, 10, 12), never
    stopped."""
    run = tmp_path_factory.mktemp("whole") / "run"
    return run, train(quick_config(run), quiet=True)


def sigint_on_call(target, call, *, before=False, times=1):
    """`target` wrapped so that its `call`-th call sends this process `times` SIGINTs, after the
    call returned (or before it began, with `before`)."""
    count = {"n": 0}

    def send():
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)

    def wrapped(*args, **kwargs):
        count["n"] += 1
        if before and count["n"] == call:
            send()
        result = target(*args, **kwargs)
        if not before and count["n"] == call:
            send()
        return result
    return wrapped


# where: (owner, what is patched, on which call, SIGINT before the call, SIGINTs, step the checkpoint holds)
WHERE = {
    "drawing the first batch": (CharLM, "training_batch", 1, False, 1, 1),
    "drawing batch 4": (CharLM, "training_batch", 4, False, 1, 4),
    "after backward, before the update": (torch.nn.utils, "clip_grad_norm_", 3, False, 1, 3),
    "right after the evaluation at step 6": (on_task, "evaluate_on_task", 1, False, 1, 6),
    "writing the checkpoint at step 5": (task_loop, "save_rotating", 1, True, 1, 5),
    "drawing the last batch (before the test)": (CharLM, "training_batch", 12, False, 1, 12),
    "twice inside step 8": (CharLM, "training_batch", 8, False, 2, 6),  # stops at once: step 6's checkpoint
}


@pytest.mark.parametrize("where", list(WHERE))
def test_a_sigint_anywhere_resumes_bit_exactly(whole, tmp_path, monkeypatch, where):
    owner, name, call, before, times, saved_step = WHERE[where]
    whole_run, uninterrupted = whole
    monkeypatch.setattr(owner, name, sigint_on_call(getattr(owner, name), call, before=before, times=times))
    run = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(quick_config(run), quiet=True)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is handler  # the run put the handler back
    assert load_checkpoint(run / TRAINING)["step"] == saved_step and not (run / "record.json").exists()
    resumed = train(quick_config(run), quiet=True)
    assert resumed.record["resumed"] == [f"resumed from {TRAINING} after step {saved_step}"]
    assert_same_parameters(uninterrupted.model, resumed.model)
    assert resumed.final_eval == uninterrupted.final_eval
    assert records(run) == records(whole_run)


def _default_sigint():  # a child of a shell that ignores SIGINT would inherit the ignoring
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lines(stream, into):
    for line in stream:
        into.put(line)
    into.put(None)


def test_a_real_sigint_to_the_command_resumes_bit_exactly(tmp_path):
    run = tmp_path / "run"
    args = ["--steps", "40", "--eval_every", "8", "--eval_tokens", "512", "--final_eval_tokens", "1024",
            "--log_every", "1", "--checkpoint_every", "15", "--model.dropout", "0.1"]
    # Every run of this test is a `routeformer train` process with one thread: bit-for-bit equality
    # holds for the same thread count (a reduction split over 2 threads rounds differently), and the
    # pytest process's thread count depends on the tests before it.
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "routeformer.cli", "train", "--config", "tiny", *args, "--out_dir"]
    child = subprocess.Popen([*command, str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_default_sigint, env=environment)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(child.stderr, lines), daemon=True).start()
    seen, deadline = [], time.monotonic() + 180
    try:  # wait for the training line of step 3 (training under way), then Ctrl-C
        while not any(" step=3/40 " in line for line in seen):
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, f"the run ended before reaching step 3: {''.join(seen)}"
            seen.append(line)
        child.send_signal(signal.SIGINT)
        status = child.wait(timeout=120)
    except (queue.Empty, subprocess.TimeoutExpired):
        child.kill()
        pytest.fail(f"waited for `routeformer train` to reach step 3 and stop on SIGINT: {''.join(seen)}")
    rest = []
    while (line := lines.get(timeout=30)) is not None:
        rest.append(line)
    assert status == 130, "".join(seen + rest)
    assert "Traceback" not in "".join(rest)
    assert rest[-1].startswith("routeformer: interrupted; run the same command again to resume"), rest
    stopped = load_checkpoint(run / TRAINING)["step"]
    assert 3 <= stopped < 40
    for out, what in ((run, "the resumed run"), (tmp_path / "whole", "the uninterrupted run")):
        try:
            finished = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=300,
                                      env=environment)
        except subprocess.TimeoutExpired:
            pytest.fail(f"waited 300 s for {what} (`routeformer train`) to finish")
        assert finished.returncode == 0, finished.stderr[-2000:]
    resumed, uninterrupted = load_checkpoint(run), load_checkpoint(tmp_path / "whole")
    assert resumed["step"] == uninterrupted["step"] == 40
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    assert records(run) == records(tmp_path / "whole")


def test_a_sigint_while_the_command_starts_is_one_line_and_changes_nothing(whole, tmp_path):
    """A real SIGINT while the package imports torch: a finder that holds the import of torch for a
    few seconds (sitecustomize.py) keeps the command in its start-up when the signal arrives, on a
    fast machine or a loaded one."""
    import shutil

    run = shutil.copytree(whole[0], tmp_path / "run")
    before = {path.name: path.read_bytes() for path in run.iterdir()}
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import sys, time\n"
        "class HoldTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            sys.meta_path.remove(self)\n"
        "            time.sleep(8)\n"
        "sys.meta_path.insert(0, HoldTorch())\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen([sys.executable, "-m", "routeformer.cli", "train", *["--config", "tiny"],
                              "--out_dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_default_sigint, env=environment)
    time.sleep(2.0)  # past Python's own start, inside the held import of torch
    child.send_signal(signal.SIGINT)
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail("waited for `routeformer train` to stop on a SIGINT sent while it started")
    # 130, or ended by the SIGINT itself (-2: Python re-raises an interrupt that arrives while it
    # finishes the exit); a shell reports both as 130. Either way: one line, no traceback.
    assert child.returncode in (130, -signal.SIGINT) and out == "", err
    assert len(err.strip().splitlines()) == 1 and err.startswith("routeformer: interrupted"), err
    assert {path.name: path.read_bytes() for path in run.iterdir()} == before


@pytest.mark.parametrize("module", ["routeformer.cli.model_commands", "routeformer.cli.sparsify_command"])
def test_a_ctrl_c_while_the_commands_modules_import_is_one_line(tmp_path, module):
    """Ctrl-C can land in any import of the command's start, after the package's own (guarded by
    routeformer/_startup.py) as well; a finder that raises KeyboardInterrupt when `module` is
    imported stands in for it, deterministically."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    finished = subprocess.run([sys.executable, "-m", "routeformer.cli", "list"], capture_output=True,
                              text=True, timeout=120, env=environment)
    assert finished.returncode == 130 and finished.stdout == "", finished.stderr
    assert finished.stderr == "routeformer: interrupted\n"
