"""Ctrl-C during training stops at a step boundary, so the interrupt checkpoint is a periodic one.

A SIGINT that lands inside a step (while a batch is drawn, in the forward or backward pass, in the
optimizer update, during an evaluation or a checkpoint write) must not be turned into a checkpoint
there: the data generator, the torch RNG, the weights or the optimizer would be saved part-way
through the step, and the resumed run would differ from one never interrupted. Inside
`DeferredInterrupts` the first SIGINT only sets a flag; the loop calls `check()` at the top of each
step, where the state is exactly what a periodic checkpoint holds, and `check()` raises
KeyboardInterrupt there. A second SIGINT stops at once (`InterruptedMidStep`, nothing is saved: the
run resumes from its last checkpoint), except while a checkpoint is being written
(`critical()`), which always completes first.

Under torchrun the ranks agree on the step to stop at: `check()` takes the maximum of the flag
over the ranks (one small all-reduce per step), so every rank stops at the same boundary and
takes part in the collective checkpoint.

Outside the main thread no handler can be installed (Python delivers signals to the main thread
only), and the guard does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class InterruptedMidStep(KeyboardInterrupt):
    """A second Ctrl-C: the run stops where it is, without saving (its last checkpoint stays)."""


class DeferredInterrupts:
    """Context manager: SIGINT is held until `check()` (see the module docstring).

    `agree(flag)` combines the flag over the ranks (default: the flag itself)."""

    def __init__(self, agree: Callable[[bool], bool] | None = None) -> None:
        self.agree = agree or (lambda flag: flag)
        self.requested = False
        self.immediate = False
        self._critical = 0
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> DeferredInterrupts:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def install(self) -> DeferredInterrupts:
        """Hold SIGINT from now on (until `restore`); returns self."""
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:  # a background job that ignores Ctrl-C keeps ignoring it
                self._previous = previous
                signal.signal(signal.SIGINT, self._handle)
                self._installed = True
        return self

    def restore(self) -> None:
        """Put back the SIGINT handler `install` replaced."""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and not self._critical:
            raise InterruptedMidStep
        if self.requested:
            self.immediate = True  # raised when the checkpoint write ends
        self.requested = True

    def check(self) -> None:
        """KeyboardInterrupt when a Ctrl-C arrived (on any rank) since the guard began."""
        if self.agree(self.requested):
            self.requested = True
            raise KeyboardInterrupt

    @contextmanager
    def critical(self, raise_after: bool = True) -> Iterator[None]:
        """A region no Ctrl-C interrupts (a checkpoint write); a second Ctrl-C that arrived in it
        stops the run right after it (`raise_after`)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if raise_after and self.immediate and not self._critical:
            raise InterruptedMidStep
