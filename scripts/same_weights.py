"""Whether two runs hold the same trained weights, bit for bit: any two run directories or
checkpoint files `train.checkpoint.load_run_model` reads (a task run, `routeformer train`'s run, or
an LM run directory of the earlier layout).

    python scripts/same_weights.py RUN_A RUN_B --out docs/results/lm-switch/README.md \
        --title "..." --note "how each run was made"

Prints the verdict (and, with --out, writes it as a report with each run's checkpoint, step and
final evaluation where its directory records one); exits 1 when a tensor differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from routeformer.bench.timing import machine_description
from routeformer.train.checkpoint import load_run_model


def final_evaluation(run: Path) -> str:
    """The final evaluation a run directory records: a task run's test (record.json), an earlier-layout
    LM run's final validation line (metrics.jsonl); "—" when neither is there."""
    if (run / "record.json").is_file():
        test = json.loads((run / "record.json").read_text())["test"]
        return f"test {test['bits_per_char']:.4f} bits/char" if "bits_per_char" in test else "—"
    if (run / "metrics.jsonl").is_file():
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        final = next((line for line in reversed(lines) if line.get("final")), None)
        if final and "val_bpc" in final:
            return f"validation {final['val_bpc']:.4f} bits/char ({final['val_tokens']:,} characters)"
    return "—"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs=2, type=Path, help="two run directories or checkpoint files")
    parser.add_argument("--out", type=Path, default=None, help="write the verdict as this report (markdown)")
    parser.add_argument("--title", default="Two runs, the same weights?", help="the report's title")
    parser.add_argument("--note", default="", help="a line saying how each run was made")
    args = parser.parse_args(argv)
    runs = [load_run_model(run, build_task=False) for run in args.runs]
    expected, got = (run.model.state_dict() for run in runs)
    differ = sorted(key for key in expected if key not in got or not torch.equal(got[key], expected[key]))
    differ += sorted(set(got) - set(expected))
    verdict = (f"all {len(expected)} tensors of the two state dicts equal bit for bit" if not differ
               else f"{len(differ)} of {len(expected)} tensors differ: {differ}")
    print(verdict)
    if args.out is not None:
        command = " ".join(["python scripts/same_weights.py", *map(str, args.runs), "--out",
                            str(args.out)])
        when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
        lines = [f"# {args.title}", "", f"Compared {when} on {machine_description()}.",
                 f"Command: `{command}`.", "", *([args.note, ""] if args.note else []),
                 "| run | checkpoint | step | final evaluation |", "|---|---|---:|---|"]
        for path, run in zip(args.runs, runs, strict=True):
            directory = path if path.is_dir() else path.parent
            evaluation = final_evaluation(directory)
            lines.append(f"| `{path}` | `{run.checkpoint.name}` | {run.step} | {evaluation} |")
        lines += ["", f"**Weights**: {verdict}.", ""]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
