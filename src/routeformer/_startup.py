"""Ctrl-C while the `routeformer` command is still importing the package (torch takes seconds):
one line on stderr and exit status 130, as anywhere else in the command, instead of a traceback.
An `import routeformer` in any other program keeps Python's KeyboardInterrupt."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def started_as_command() -> bool:
    """Whether this process is the `routeformer` console script or `python -m routeformer.cli`."""
    argv = list(getattr(sys, "orig_argv", []))
    for index, argument in enumerate(argv[:-1]):
        if argument == "-m":
            return argv[index + 1] == "routeformer.cli"
    return bool(sys.argv) and Path(sys.argv[0]).name == "routeformer"


@contextmanager
def interrupt_as_one_line() -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt:
        if not started_as_command():
            raise
        print("routeformer: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
