"""`routeformer compare`: every mechanism trained on the same tasks, seeds and budget, then measured.

budgets.py        the QUICK, FULL and LONG (`compare --long`: curricula, tests at 2T and 4T) budgets
                  and the options each mechanism gets at a length
run.py            run_compare: the jobs, the floors, the costs, the layer benchmark, the report
costs.py          each mechanism's step time, inference time and peak memory on a task (a staged
                  task's: beside full, at every evaluated length)
report/           the report: a one-stage task's section (mean ± sd, floors, separated pairs,
                  Pareto front) and a staged task's (per length, Δ vs full, where routing pays),
                  written with the same table pieces
stats.py          separation by 3 sd, floors, the paired Δ vs full and the Pareto front
Training a job (one model through its setup's stages) is runner/jobs.py's train_job.
"""
