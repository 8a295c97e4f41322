"""Stopping on a signal: Ctrl-C (SIGINT) and a scheduler's SIGTERM are one kind of stop.

Slurm, Kubernetes and spot instances stop a job with SIGTERM, wait a grace period (Slurm: 30 s by
default), then SIGKILL it. Every `spec` command treats SIGTERM as it treats Ctrl-C (`sigterm_as_ctrl_c`,
installed by cli.main): the stage's KeyboardInterrupt path keeps the finished work (regenerate's chunks,
precompute's shards, train's steps) and the command exits 128 + the signal's number (130, 143).

`spec train` does better than abandon the step in flight (`StopRequests`): the first signal only asks,
the loop finishes its step, every rank agrees on that step (under torchrun the ranks get the signal at
different moments; the request rides on the step's one host sync, so it costs no extra wait on a GPU),
and one consistent checkpoint is saved if the save fits in what is left of --stop-grace. A second
signal, or the grace running out while the step is still running, abandons the step at once: then the
last checkpoint already written is the one a --resume continues from (a checkpoint is renamed into
place only once complete, so a SIGKILL during a save leaves the previous one trusted).
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
DEFAULT_GRACE = 30.0  # seconds: Slurm's default KillWait between SIGTERM and SIGKILL


_last_signal: int | None = (
    None  # the signal of the last Stopped raised (typer turns any into exit 130)
)


class Stopped(KeyboardInterrupt):
    """A stop a signal asked for. A KeyboardInterrupt, so every Ctrl-C path keeps what it keeps."""

    def __init__(self, signum: int = signal.SIGINT):
        global _last_signal
        super().__init__(SIGNAL_NAMES.get(signum, f"signal {signum}"))
        self.signum = _last_signal = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return SIGNAL_NAMES.get(self.signum, f"signal {self.signum}")


def last_stop() -> Stopped:
    """The stop that ended the command (typer reports any KeyboardInterrupt as exit 130): the last
    Stopped raised since sigterm_as_ctrl_c began, else Ctrl-C's."""
    return Stopped(_last_signal if _last_signal is not None else signal.SIGINT)


def in_chain(exc: BaseException) -> KeyboardInterrupt | None:
    """The stop inside an error a library made of it (transformers' loader, pyarrow's readers turn an
    interrupt raised in their callbacks into errors of their own): the first KeyboardInterrupt among
    `exc`'s causes and contexts, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def signal_name(exc: BaseException) -> str:
    return exc.name if isinstance(exc, Stopped) else "Ctrl-C"


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class sigterm_as_ctrl_c:
    """While active (the main thread only), SIGTERM raises Stopped(SIGTERM) as Ctrl-C raises
    KeyboardInterrupt. A SIGTERM the process was started ignoring stays ignored."""

    def __enter__(self):
        global _last_signal
        self.previous, _last_signal = None, None
        if _in_main_thread() and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGTERM, _raise_stopped)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


class StopRequests:
    """The training loop's signals, while active: the first SIGINT/SIGTERM is a request (`signum`, `at`)
    the loop answers at its next step boundary; a second one, or the grace period running out (less the
    seconds a save needs) while a step still runs, raises Stopped in the main thread: the step is
    abandoned. A signal ignored at start (a background job's SIGINT) stays ignored."""

    def __init__(self, grace: float = DEFAULT_GRACE):
        self.grace = float(grace)
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() of the first signal
        self.save_seconds: float | None = (
            None  # the last checkpoint save's duration (the loop reports it)
        )
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._answered = False
        self._shielded = (
            False  # inside the optimizer update: an abandon waits until the step is counted
        )
        self._pending: int | None = None
        self.stopped = (
            False  # the loop stopped at a step boundary, its work saved (or said why not)
        )

    def __enter__(self) -> StopRequests:
        if _in_main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        self._cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextmanager
    def shielded(self):
        """A stretch an abandon must not cut in two (the weights updated, the step not yet counted): a
        stop that comes inside it is raised as it ends."""
        self._shielded = True
        try:
            yield
        finally:
            self._shielded = False
        if self._pending is not None:
            signum, self._pending = self._pending, None
            raise Stopped(signum)

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal (or the grace's end): stop now
            if self._shielded:
                self._pending = int(signum)
                return
            raise Stopped(signum)
        self.signum, self.at = int(signum), time.monotonic()
        # left for the step in flight: the grace less what a save takes (a third of it before one was timed)
        reserve = self.save_seconds * 1.5 + 2 if self.save_seconds is not None else self.grace / 3
        self._timer = threading.Timer(max(0.0, self.grace - reserve), self._abandon)
        self._timer.daemon = True
        self._timer.start()

    def _abandon(self) -> None:
        if not self._answered:  # the step outlived its share of the grace: interrupt it
            signal.raise_signal(self.signum if self.signum is not None else signal.SIGINT)

    def answered(self) -> None:
        """The loop reached a step boundary and is stopping there: the step is no longer abandoned."""
        self._answered = True
        self._cancel()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def left(self) -> float:
        """Seconds of the grace period left (the whole of it before any signal)."""
        return self.grace if self.at is None else self.grace - (time.monotonic() - self.at)

    def save_fits(self) -> bool:
        """Whether a checkpoint save can finish before the grace ends (unknown before one was timed: try;
        a save cut short by SIGKILL is never renamed into place)."""
        return self.save_seconds is None or self.save_seconds * 1.2 + 1 <= self.left()
