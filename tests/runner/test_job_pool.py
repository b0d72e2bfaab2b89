"""run_jobs' worker processes (spawned): two runs finish in two workers; the wait is bounded —
past `timeout_s` the workers are stopped and a TimeoutError names the unfinished runs. Every job
trains on one thread, in a worker or in the calling process, so its record does not depend on the
number of workers."""

import multiprocessing
import re
import time
from dataclasses import replace

import pytest
import torch

from routeformer.runner.jobs import Job, TaskSetup, run_jobs
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule


def tiny_jobs(count: int) -> list[Job]:
    setup = TaskSetup(options={}, schedule=Schedule(steps=2, batch_size=4, lr=1e-3, warmup_steps=1), evals=1,
                      validation_sequences=8, test_sequences=8)
    task_options = {"seq_len": 16, "pairs": 2, "vocab_size": 16}
    return [Job(key=f"mqar-full-s{seed}", task="mqar", task_options=task_options, mechanism="full",
                options={},
                seed=seed, setup=setup) for seed in range(count)]


def test_two_runs_finish_in_two_spawned_workers(tmp_path):
    lines = []
    records = run_jobs(tmp_path, tiny_jobs(2), workers=2, progress=lines.append, timeout_s=240)
    assert sorted(records) == ["mqar-full-s0", "mqar-full-s1"]
    assert all("error" not in record for record in records.values()), records
    assert sorted((tmp_path / "runs").glob("*.json")) and len(lines) == 2
    assert multiprocessing.active_children() == []  # the pool's workers are gone


def test_the_wait_for_the_workers_is_bounded(tmp_path):
    """0.5 s is less than a spawned worker needs to import torch: the runs cannot finish."""
    began = time.monotonic()
    unfinished = r"2 run\(s\) unfinished after 0.5 s .*'mqar-full-s0', 'mqar-full-s1'"
    with pytest.raises(TimeoutError, match=unfinished):
        run_jobs(tmp_path, tiny_jobs(2), workers=2, progress=lambda line: None, timeout_s=0.5)
    assert time.monotonic() - began < 60  # stopped, not waited for
    assert multiprocessing.active_children() == []
    assert not list((tmp_path / "runs").glob("*.json"))


def _threads_of(job):
    """A job's record: the number of threads it ran on (a module-level function: workers import it)."""
    return {"threads": torch.get_num_threads(), "quality": float(job.seed)}


@pytest.mark.parametrize("workers", [1, 2])
def test_every_job_trains_on_one_thread_whatever_the_number_of_workers(tmp_path, workers):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        records = run_jobs(tmp_path, tiny_jobs(2), workers=workers, progress=lambda line: None,
                           timeout_s=240, train=_threads_of)
        assert [record["threads"] for record in records.values()] == [1, 1]
        assert torch.get_num_threads() == 2  # the caller's count is left as it was
    finally:
        torch.set_num_threads(before)


def _device_of(job):
    """A job's record: the device its model would be built on (a module-level function: workers import it)."""
    from routeformer.train.task_loop import training_device

    return {"device": str(training_device()), "quality": float(job.seed)}


@pytest.mark.parametrize("workers", [1, 2])
def test_every_job_trains_on_the_device_asked_for_in_a_worker_or_here(tmp_path, workers):
    """torch's meta device stands in for a GPU: the name reaches the spawned workers' training_on."""
    records = run_jobs(tmp_path, tiny_jobs(2), workers=workers, progress=lambda line: None,
                       timeout_s=240, train=_device_of, device="meta")
    assert [record["device"] for record in records.values()] == ["meta", "meta"]


def test_a_stored_run_of_another_device_is_refused_and_kept(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    stored = runs / "mqar-full-s0.json"
    stored.write_text('{"quality": 0.5, "device": "cuda:0"}')
    with pytest.raises(ValueError, match=r"^device: .*mqar-full-s0.json' was trained on cuda:0, this sweep "
                                         r"trains on cpu; use another output directory$"):
        run_jobs(tmp_path, tiny_jobs(1), workers=1, progress=lambda line: None, train=_device_of)
    assert stored.read_text() == '{"quality": 0.5, "device": "cuda:0"}'
    records = run_jobs(tmp_path, tiny_jobs(1), workers=1, progress=lambda line: None, train=_device_of,
                       device="cuda")  # the same kind of device: read back, not trained
    assert records["mqar-full-s0"] == {"quality": 0.5, "device": "cuda:0"}


def test_a_device_torch_does_not_know_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^device: a torch device such as 'cpu' or 'cuda:0'; got 'gpu0'$"):
        run_jobs(tmp_path, tiny_jobs(1), workers=1, progress=lambda line: None, device="gpu0")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("change, named", [
    ({"mechanism": "local", "options": {"window": 4}}, "mechanism 'full', this job 'local'"),
    ({"spec": ModelSpec(dim=32)}, "model {'dim': 64"),
    ({"options": {"block": 8}}, "options {}, this job {'block': 8}"),
])
def test_a_stored_record_of_another_run_under_the_same_key_is_refused(tmp_path, change, named):
    """A record is read back only as the run of its job: another mechanism, layer options or backbone
    under the same key (another budget in the same directory) is refused, never reported as this."""
    job, = tiny_jobs(1)
    first = run_jobs(tmp_path, [job], workers=1, progress=lambda line: None)
    assert run_jobs(tmp_path, [job], workers=1, progress=lambda line: None) == first  # read back
    with pytest.raises(ValueError, match=r"mqar-full-s0.json' holds another run under this job's key \(.*"
                       + re.escape(named)):
        run_jobs(tmp_path, [replace(job, **change)], workers=1, progress=lambda line: None)
