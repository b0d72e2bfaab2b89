"""compare's runs report their progress while they train, not only when they finish."""

from routeformer.runner.jobs import Job, TaskSetup, train_job
from routeformer.train.schedule import Schedule


def test_a_run_says_when_it_starts_and_at_each_evaluation(capsys):
    setup = TaskSetup(options={}, schedule=Schedule(steps=4, batch_size=4, lr=1e-3, warmup_steps=1), evals=2,
                      validation_sequences=8, test_sequences=8)
    job = Job(key="mqar-full-s0", task="mqar", task_options={"seq_len": 16, "pairs": 2, "vocab_size": 16},
              mechanism="full", options={}, seed=0, setup=setup)
    record = train_job(job)
    lines = capsys.readouterr().err.rstrip().splitlines()
    assert lines[0] == "  mqar-full-s0: started (4 steps)"
    assert [line.split()[1] for line in lines[1:]] == ["step=2/4", "step=4/4"]
    assert all(line.startswith("  mqar-full-s0: ") for line in lines)
    assert f"accuracy={record['validation'][-1]['accuracy']:.4g}" in lines[-1]
