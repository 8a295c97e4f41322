"""Terminal output: one console; progress as a bar on a terminal, as plain lines in a log.

Under torchrun every rank runs the same command and would say every line once per rank: rank 0 alone
says them (progress lines, warnings, bars, summaries). The other ranks print their own errors (cli.py),
and a line only they can say (`info(..., every_rank=True)`: a rank waiting for rank 0)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from rich.text import Text

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def is_quiet() -> bool:
    return _quiet


def other_rank() -> bool:
    """A torchrun rank other than 0 (RANK > 0): its lines are rank 0's again, so it keeps them to itself."""
    return os.environ.get("RANK", "0").strip() not in ("", "0")


def info(message: str, markup: bool = False, every_rank: bool = False) -> None:
    """A progress line for the user (suppressed by --quiet; rank 0's alone under torchrun, unless
    `every_rank`: a line about this rank). Plain text unless `markup`: messages carry paths and library
    errors, whose brackets are not rich markup."""
    if not _quiet and (every_rank or not other_rank()):
        console.print(message, markup=markup, soft_wrap=not console.is_terminal)


def warn(message: str) -> None:
    """A warning the user must see: on stderr, --quiet or not (rank 0's alone under torchrun). Plain text
    (paths, library errors)."""
    if not other_rank():
        err_console.print(
            Text.assemble(("warning: ", "bold yellow"), message),
            soft_wrap=not err_console.is_terminal,
        )


# Off a terminal (a log file, Slurm, nohup) rich would wrap a line at 80 columns: `info` and `warn`
# leave a line whole there, so a log holds each message on one line that grep finds.


def progress_enabled() -> bool:
    """Progress as a live bar: stdout is a terminal (rank 0, not --quiet)."""
    return not _quiet and not other_rank() and sys.stdout.isatty()


def progress_lines_enabled() -> bool:
    """Progress as plain lines (`ProgressLines`): stdout is a file or a pipe (rank 0, not
    --quiet)."""
    return not _quiet and not other_rank() and not sys.stdout.isatty()


# ----------------------------------------------------------------------------- progress bars
#
# rich's own TimeRemainingColumn estimates the speed from the advances of the last 30 s only, so a
# bar that advances less often than that (precompute: a target batch per ~50 s on CPU) reads
# `-:--:--` throughout. Here the rate and the time left come from all the work done so far, as of
# the last advance, and the time left counts down between advances.


def human_bytes(n: float) -> str:
    """Decimal units, as disk tools print them: 1234567 -> "1.23 MB"."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"


def _amount(x: float) -> str:
    """1234 -> '1234', 56789 -> '56.8k', 12345678 -> '12.3M'."""
    if x >= 1e9:
        return f"{x / 1e9:.2f}G"
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


def _fixed() -> Column:
    """A column of numbers: never wrapped, so a narrow terminal shrinks the bar instead."""
    return Column(no_wrap=True)


def _spent(task: Task) -> float | None:
    """Seconds from the task's start to its last advance; None before the first."""
    at = task.fields.get("advanced_at")
    if at is None or task.start_time is None or at <= task.start_time:
        return None
    return at - task.start_time


class CountColumn(ProgressColumn):
    """Done of total, in the bar's unit: `1.2M/40.0M tokens`."""

    def __init__(self, unit: str):
        super().__init__(table_column=_fixed())
        self.unit = unit

    def render(self, task: Task) -> Text:
        total = f"/{_amount(task.total)}" if task.total is not None else ""
        return Text(f"{_amount(task.completed)}{total} {self.unit}", style="progress.download")


class RateColumn(ProgressColumn):
    """Units per second since the start: of what the bar advanced, or with `counted` of the `count`s
    passed to `advance` (tokens of a bar that counts turns)."""

    def __init__(self, unit: str, counted: bool = False):
        super().__init__(table_column=_fixed())
        self.unit, self.field = unit, "counted" if counted else "advanced"

    def render(self, task: Task) -> Text:
        spent = _spent(task)
        if spent is None:
            return Text(f"- {self.unit}/s", style="progress.data.speed")
        rate = task.fields[self.field] / spent
        return Text(
            f"{_amount(rate) if rate >= 100 else f'{rate:.3g}'} {self.unit}/s",
            style="progress.data.speed",
        )


class EtaColumn(ProgressColumn):
    """Time left: what remains at the rate so far, less the time since the last advance."""

    def __init__(self):
        super().__init__(table_column=_fixed())

    def render(self, task: Task) -> Text:
        spent, advanced = _spent(task), task.fields.get("advanced", 0)
        if task.finished:
            left = 0.0
        elif task.total is None or spent is None or advanced <= 0:
            return Text("eta -:--:--", style="progress.remaining")
        else:
            since = (task.elapsed or spent) - spent
            left = max((task.total - task.completed) * spent / advanced - since, 0.0)
        return Text(f"eta {_clock(left)}", style="progress.remaining")


def progress_display(unit: str, rate: str | None = None, **kwargs) -> Progress:
    """A rich Progress (not started) whose bars show done/total in `unit`, a rate (per second of
    `unit`, or of `rate` counted by `advance(n, count)`), the time elapsed and the time left. It
    re-renders twice a second, so elapsed and time left move between advances."""
    return Progress(
        TextColumn("[bold]{task.description}", table_column=_fixed()),
        BarColumn(bar_width=None),
        CountColumn(unit),
        RateColumn(rate or unit, counted=rate is not None),
        TimeElapsedColumn(table_column=_fixed()),
        EtaColumn(),
        console=console,
        refresh_per_second=2,
        **kwargs,
    )


class Bar:
    """One task of a progress display: `advance(n, count=0)` moves it n units of its total and adds
    `count` to what a `rate` column counts. `completed` starts it part done (a resumed run): the
    rate and time left count only what this run does."""

    def __init__(self, display: Progress, description: str, total: int | None, completed: int = 0):
        self.display, self.advanced, self.counted = display, 0, 0
        self.task_id = display.add_task(
            description, total=total, completed=completed, advanced=0, counted=0
        )

    def advance(self, n: int = 1, count: int = 0) -> None:
        self.advanced += n
        self.counted += count
        self.display.update(
            self.task_id,
            advance=n,
            advanced=self.advanced,
            counted=self.counted,
            advanced_at=self.display.get_time(),
        )


class _NullTask:
    def advance(self, n: int = 1, count: int = 0) -> None:
        pass


# ----------------------------------------------------------------------------- progress lines
#
# Nobody watches a log: a bar there is either nothing or a stream of carriage returns. Off a
# terminal progress is plain lines instead: one when the work starts, one at an advance once
# LINE_INTERVAL_S have passed since the last line, one from a background thread when no advance came
# for that long (a vLLM batch of a whole chunk can take many minutes), and one at the end. Each is
# flushed.

LINE_INTERVAL_S = 30.0


def _now() -> float:
    """The clock of the progress lines (tests replace it)."""
    return time.monotonic()


def duration(seconds: float) -> str:
    """42 -> '42s', 294 -> '4m54s', 7500 -> '2h05m'."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _per_second(x: float) -> str:
    return _amount(x) if x >= 100 else f"{x:.3g}"


class ProgressLines:
    """`advance(n, count=0)` as `Bar` has it, said in lines such as `regenerating: 120/800 turns,
    31.2 tokens/s, 1m02s so far, 4m54s left`. The rate and the time left come from all of this run's
    work as of its last advance (`completed`: a resumed run's part done before it), as the bar's
    do."""

    def __init__(
        self,
        description: str,
        total: int | None,
        *,
        unit: str,
        rate: str | None = None,
        completed: int = 0,
        announce: bool = True,
    ):
        """announce False: no start line (the stage has said its work in its own words)."""
        self.description, self.total, self.unit, self.rate = description, total, unit, rate
        self.completed, self.advanced, self.counted = completed, 0, 0
        self.start = self.advanced_at = self.said_at = _now()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if announce:
            what = f"{_amount(total - completed)} {unit} to do" if total is not None else "started"
            before = f" ({_amount(completed)} done before)" if completed else ""
            self._say(f"{description}: {what}{before}")
        self._thread = threading.Thread(target=self._heartbeat, name="progress-lines", daemon=True)
        self._thread.start()

    def advance(self, n: int = 1, count: int = 0) -> None:
        with self._lock:
            self.completed += n
            self.advanced += n
            self.counted += count
            self.advanced_at = _now()
            if self.total is None or self.completed < self.total:  # the last line says the end
                self._line_if_due()

    def heard(self) -> None:
        """The stage printed its own progress just now (`spec train`'s step records): the next
        line comes LINE_INTERVAL_S after it, so lines fill only the silences between records."""
        with self._lock:
            self.said_at = _now()

    def tick(self) -> None:
        """A line if none came for LINE_INTERVAL_S (the heartbeat calls it)."""
        with self._lock:
            self._line_if_due()

    def close(self) -> None:
        """The last line (the work done, its rate and time); the heartbeat stops."""
        self.stop()
        with self._lock:
            self._say(self.line(done=True))

    def stop(self) -> None:
        """The heartbeat stops, without a last line (an error or a stop says itself)."""
        self._closed.set()
        self._thread.join()

    def line(self, done: bool = False) -> str:
        """done/total in the unit, the rate, the time so far and the time left."""
        now = _now()
        total = f"/{_amount(self.total)}" if self.total is not None else ""
        parts = [f"{_amount(self.completed)}{total} {self.unit}"]
        spent = self.advanced_at - self.start  # to the last advance: what the rate is measured over
        if self.advanced > 0 and spent > 0:
            parts.append(
                f"{_per_second((self.counted if self.rate else self.advanced) / spent)} "
                f"{self.rate or self.unit}/s"
            )
        if done:
            return f"{self.description}: {', '.join(parts)}, done in {duration(now - self.start)}"
        parts.append(f"{duration(now - self.start)} so far")
        if self.total is not None and self.advanced > 0 and spent > 0:
            # what remains at the rate so far, less the time since the last advance
            left = (self.total - self.completed) * spent / self.advanced - (now - self.advanced_at)
            parts.append(f"{duration(left)} left")
        return f"{self.description}: {', '.join(parts)}"

    def _line_if_due(self) -> None:
        if _now() - self.said_at >= LINE_INTERVAL_S:
            self._say(self.line())

    def _say(self, text: str) -> None:
        self.said_at = _now()
        console.print(Text(text), soft_wrap=True)  # one line, no markup; rich flushes each print

    def _heartbeat(self) -> None:
        """A line when no advance said one for LINE_INTERVAL_S: the elapsed time grows, the time
        left counts down."""
        while not self._closed.wait(max(LINE_INTERVAL_S, 1.0)):
            self.tick()


@contextlib.contextmanager
def progress(
    description: str, total: int | None, *, unit: str, rate: str | None = None
) -> Iterator:
    """Progress over `total` `unit`s; yields an object with `advance(n, count=0)`. With `rate` (a
    unit, e.g. "tokens") the rate shown is of the `count`s advanced per second instead of the units.
    A bar on a terminal; off one (a log, Slurm, nohup) `ProgressLines`; nothing with --quiet or on a
    rank other than 0."""
    if progress_enabled():
        with progress_display(unit, rate) as display:
            yield Bar(display, description, total)
    elif progress_lines_enabled():
        lines = ProgressLines(description, total, unit=unit, rate=rate)
        try:
            yield lines
        except BaseException:
            lines.stop()
            raise
        lines.close()
    else:
        yield _NullTask()


# ----------------------------------------------------------------------------- summaries


def summary(title: str, rows: list[tuple[str, object]]) -> None:
    """The one-screen summary printed at the end of each stage. A value too long for the terminal
    wraps (a path folds across lines) rather than being cut: users copy these. Rank 0's alone under
    torchrun."""
    if _quiet or other_rank():
        return
    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(Text(key), Text(str(value)))  # values are paths and messages, not rich markup
    console.print(table)
