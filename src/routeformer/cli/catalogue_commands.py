"""The commands that describe what is available: list (mechanisms and experiments), reproduce
(run one paper experiment, or list them) and doctor (what this machine has)."""

from __future__ import annotations

import argparse


def command_doctor(args: argparse.Namespace) -> int:
    from routeformer.doctor import report

    print(report(args.length), end="")
    return 0


def command_list(args: argparse.Namespace) -> int:
    from routeformer.attention import list_attentions
    from routeformer.experiments.registry import list_experiments

    print("attention mechanisms:")
    for name, options in list_attentions().items():
        shown = ", ".join(f"{key}={value!r}" for key, value in options.items())
        print(f"  {name:12s} {shown}")
    print("experiments (routeformer reproduce NAME):")
    for name, experiment in list_experiments().items():
        print(f"  {name:14s} {experiment.description}")
    return 0


def command_reproduce(args: argparse.Namespace) -> int:
    from routeformer.experiments.registry import list_experiments, run_experiment

    if args.list or not args.name:
        for name, experiment in list_experiments().items():
            print(f"{name:14s} {experiment.description}")
        return 0
    report = run_experiment(args.name, args.out, quick=args.quick)
    print(report.read_text())
    print(f"wrote {report.parent}/ (result.json, report.md, PNGs)")
    return 0

