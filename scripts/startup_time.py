"""Start-up time of the `routeformer` command against PyTorch's own import.

Times `python -m routeformer.cli --help` (the `routeformer` command) and
`python -c "import torch"` in fresh processes, the two alternating,
and prints the median of each over `--repeats` runs and their ratio.

    PYTHONPATH=src python scripts/startup_time.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "routeformer --help": [sys.executable, "-m", "routeformer.cli", "--help"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
}


def wall_seconds(command: list[str]) -> float:
    """Seconds from starting `command` to its exit; raises CalledProcessError if it fails."""
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5)")
    arguments = parser.parse_args()
    if arguments.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {arguments.repeats}")
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(arguments.repeats):
        for name, command in COMMANDS.items():
            times[name].append(wall_seconds(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:28s} median {median:.2f} s over {arguments.repeats} runs")
    command_time, torch_time = medians.values()
    print(f"ratio {command_time / torch_time:.2f}x")


if __name__ == "__main__":
    main()
