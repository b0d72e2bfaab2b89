"""Whether two `routeformer compare` invocations gave the same quality numbers, seed by seed.

    python scripts/compare_identity.py BEFORE/result.json AFTER/result.json [--out identity.txt]
    python scripts/compare_identity.py BEFORE AFTER [--out identity.txt]   # two --out directories

Prints one line per (task, mechanism) cell, the per-seed qualities on both sides and whether every
one is equal bit for bit, then the count; exits 1 when a cell differs or is missing on one side. A
directory is read through its run records (`runs/<key>.json`: the training runs of an invocation
stopped before it wrote result.json, such as one stopped in its cost measurements), or, for a
`routeformer train --task` run directory, its record.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def per_seed(path: Path) -> dict[tuple[str, str], list[float]]:
    """{(task, mechanism): the per-seed qualities} of a compare result.json, or of the run records of
    a compare output directory (in seed order)."""
    if path.is_dir():
        single = path / "record.json"  # a `routeformer train --task` run directory
        runs = [single] if single.is_file() else sorted((path / "runs").glob("*.json"))
        records = [json.loads(run.read_text()) for run in runs]
        cells: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for record in records:
            if "mechanism" in record and "seed" in record:  # not the floors' records
                cells.setdefault((record["task_name"], record["mechanism"]), []).append(
                    (record["seed"], record["quality"]))
        return {cell: [quality for _, quality in sorted(seeds)] for cell, seeds in cells.items()}
    tasks = json.loads(path.read_text())["tasks"]
    return {(task, row["mechanism"]): row["qualities"]
            for task, data in tasks.items() for row in data["rows"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="also write the lines here")
    args = parser.parse_args()
    before, after = per_seed(args.before), per_seed(args.after)
    lines, same = [], 0
    for cell in sorted(before.keys() | after.keys()):
        left, right = before.get(cell), after.get(cell)
        equal = left == right
        same += equal
        verdict = "identical" if equal else ("DIFFERENT" if left and right else "MISSING on one side")
        lines.append(f"{cell[0]:8s} {cell[1]:8s} {verdict}: before {left} after {right}")
    total = len(before.keys() | after.keys())
    seeds = sum(len(values) for values in before.values())
    lines.append(f"{same} of {total} (task, mechanism) cells identical in every seed "
                 f"({seeds} per-seed numbers before)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
