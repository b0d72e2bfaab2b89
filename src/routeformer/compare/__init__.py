"""`routeformer compare`: every mechanism trained on the same tasks, seeds and budget, then measured.

budgets.py        the QUICK, FULL and LONG (`compare --long`: curricula, tests at 2T and 4T) budgets
                  and the options each mechanism gets at a length
run.py            run_compare: the jobs, the floors, the costs, the layer benchmark, the report
costs.py          each mechanism's step time, inference time and peak memory on a task (a staged
                  task's: beside full, at every evaluated length)
report.py         the report (mean ± sd, floors, separated pairs, Pareto front)
staged_report.py  a staged task's sections: per length, Δ vs full, where routing pays
stats.py          separation by 3 sd and the Pareto front
Training a job (one model through its setup's stages) is runner/jobs.py's train_job.
"""
