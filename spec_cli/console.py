"""Terminal output: one console, progress bars that switch off when output is not a terminal."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def is_quiet() -> bool:
    return _quiet


def info(message: str, markup: bool = False) -> None:
    """A progress line for the user (suppressed by --quiet). Plain text unless `markup`: messages
    carry paths and library errors, whose brackets are not rich markup."""
    if not _quiet:
        console.print(message, markup=markup)


def progress_enabled() -> bool:
    return not _quiet and sys.stdout.isatty()


class _NullTask:
    def advance(self, n: int = 1, count: int = 0) -> None:
        pass


class _RateColumn(ProgressColumn):
    """The task's `count` field (what the caller produced, e.g. tokens) per second elapsed."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        elapsed = task.elapsed or 0.0
        rate = task.fields.get("count", 0) / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} {self.unit}/s")


@contextlib.contextmanager
def progress(description: str, total: int | None, rate: str | None = None) -> Iterator:
    """A rich progress bar; yields an object with `advance(n, count=0)`. With `rate` (a unit, e.g.
    "tokens") it also shows the `count`s advanced per second. Disabled off a terminal."""
    if not progress_enabled():
        yield _NullTask()
        return
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *([_RateColumn(rate)] if rate else []),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        task_id = bar.add_task(description, total=total, count=0)

        class _Task:
            counted = 0

            def advance(self, n: int = 1, count: int = 0) -> None:
                self.counted += count
                bar.update(task_id, advance=n, count=self.counted)

        yield _Task()


def summary(title: str, rows: list[tuple[str, object]]) -> None:
    """The one-screen summary printed at the end of each stage."""
    if _quiet:
        return
    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)
