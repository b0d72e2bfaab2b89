"""The runner that `routeformer compare` and the paper experiments share: jobs run in worker
processes and stored as JSON when finished (jobs.py), the order of seeds and (variant, seed) runs
(seeds.py), and one report module (report.py: mean ± sd with one sd convention, tables, plots,
result files). It imports neither compare nor experiments, so both build on it without an import
cycle."""
