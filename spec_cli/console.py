"""Terminal output: one console, progress bars that switch off when output is not a terminal.

Under torchrun every rank runs the same command and would say every line once per rank: rank 0 alone
says them (progress lines, warnings, bars, summaries). The other ranks print their own errors (cli.py),
and a line only they can say (`info(..., every_rank=True)`: a rank waiting for rank 0)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

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
        console.print(message, markup=markup)


def warn(message: str) -> None:
    """A warning the user must see: on stderr, --quiet or not (rank 0's alone under torchrun). Plain text
    (paths, library errors)."""
    if not other_rank():
        err_console.print(Text.assemble(("warning: ", "bold yellow"), message))


def progress_enabled() -> bool:
    return not _quiet and not other_rank() and sys.stdout.isatty()


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
        return Text(f"{_amount(rate) if rate >= 100 else f'{rate:.3g}'} {self.unit}/s",
                    style="progress.data.speed")


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
    return Progress(TextColumn("[bold]{task.description}", table_column=_fixed()), BarColumn(bar_width=None),
                    CountColumn(unit), RateColumn(rate or unit, counted=rate is not None),
                    TimeElapsedColumn(table_column=_fixed()), EtaColumn(), console=console,
                    refresh_per_second=2, **kwargs)


class Bar:
    """One task of a progress display: `advance(n, count=0)` moves it n units of its total and adds
    `count` to what a `rate` column counts. `completed` starts it part done (a resumed run): the
    rate and time left count only what this run does."""

    def __init__(self, display: Progress, description: str, total: int | None, completed: int = 0):
        self.display, self.advanced, self.counted = display, 0, 0
        self.task_id = display.add_task(description, total=total, completed=completed, advanced=0, counted=0)

    def advance(self, n: int = 1, count: int = 0) -> None:
        self.advanced += n
        self.counted += count
        self.display.update(self.task_id, advance=n, advanced=self.advanced, counted=self.counted,
                            advanced_at=self.display.get_time())


class _NullTask:
    def advance(self, n: int = 1, count: int = 0) -> None:
        pass


@contextlib.contextmanager
def progress(description: str, total: int | None, *, unit: str, rate: str | None = None) -> Iterator:
    """A progress bar of `total` `unit`s; yields an object with `advance(n, count=0)`. With `rate` (a
    unit, e.g. "tokens") its rate column shows the `count`s advanced per second instead of the units.
    Disabled off a terminal."""
    if not progress_enabled():
        yield _NullTask()
        return
    with progress_display(unit, rate) as display:
        yield Bar(display, description, total)


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
