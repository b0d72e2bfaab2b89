"""Whether `routeformer train --config FILE` (the LM run) and `routeformer train --task lm --config
FILE` (the task run it translates to, `runner.lm_config.lm_config_job`) train the same weights.

    python scripts/lm_task_parity.py --config char-lm --out docs/results/lm-task-parity/README.md

Trains both in temporary directories (one thread each, one after the other), then compares every
entry of the two checkpoints' state dicts bit for bit and writes a report with each run's final
evaluation (the LM run's validation bits/char on its held-out text, the task
run's test bits/char on its test split) and the verdict; exits 1 when a tensor differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

from routeformer.bench.timing import machine_description
from routeformer.cli import main as routeformer
from routeformer.train.checkpoint import load_run_model


def _train(argv: list[str]) -> None:
    status = routeformer(argv)
    if status != 0:
        raise SystemExit(f"routeformer {' '.join(argv)} exited {status}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="char-lm", help="a bundled config name or a YAML path")
    parser.add_argument("--out", type=Path, required=True, help="the report (markdown)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    began = datetime.datetime.now(datetime.UTC)
    with tempfile.TemporaryDirectory() as scratch:
        lm, task = Path(scratch) / "lm", Path(scratch) / "task"
        _train(["train", "--config", args.config, "--out_dir", str(lm)])
        _train(["train", "--task", "lm", "--config", args.config, "--out", str(task)])
        runs = [load_run_model(run, build_task=False) for run in (lm, task)]
        record = json.loads((task / "record.json").read_text())
        windows = json.loads((task / "config.json").read_text())["setup"]["test_sequences"]
        final = [json.loads(line) for line in (lm / "metrics.jsonl").read_text().splitlines()][-1]
    expected, got = (run.model.state_dict() for run in runs)
    differ = sorted(key for key in expected if key not in got or not torch.equal(got[key], expected[key]))
    differ += sorted(set(got) - set(expected))
    verdict = (f"all {len(expected)} tensors of the two state dicts equal bit for bit" if not differ
               else f"{len(differ)} of {len(expected)} tensors differ: {differ}")
    lines = [
        "# `routeformer train` and `routeformer train --task lm` train the same weights",
        "",
        f"Measured {began:%Y-%m-%d %H:%M} UTC on {machine_description()}. Command: "
        f"`python scripts/lm_task_parity.py --config {args.config} --out {args.out}`.",
        "",
        "| run | command | steps | final evaluation |",
        "|---|---|---:|---|",
        f"| LM run | `routeformer train --config {args.config}` | {runs[0].step} | "
        f"validation {final['val_bpc']:.4f} bits/char ({final['val_tokens']:,} characters of its held-out "
        "text) |",
        f"| task run | `routeformer train --task lm --config {args.config}` | {runs[1].step} | "
        f"test {record['quality']:.4f} bits/char ({windows} windows of task lm's test "
        "split) |",
        "",
        f"**Weights**: {verdict}.",
        "",
        "The two final numbers differ because they read different text (the LM run its whole held-out "
        "text, the task run task lm's test split); the weights they evaluate are the same.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
