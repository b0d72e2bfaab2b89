"""`routeformer compare`: every mechanism trained on the same tasks, seeds and budget, then measured.

budgets.py   the QUICK and FULL budgets and the options each mechanism gets at a length
run.py       run_compare: the jobs, the floors, the costs, the layer benchmark, the report
report.py    the report (mean ± sd, floors, separated pairs, Pareto front) and its statistics
costs.py     one mechanism's step time, inference time and peak memory on a task
long_*.py    `compare --long`: budget, training jobs, costs beside full, run, report
"""
