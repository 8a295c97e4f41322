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
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

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
    def advance(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress(description: str, total: int | None) -> Iterator:
    """A rich progress bar; yields an object with `advance(n)`. Disabled off a terminal."""
    if not progress_enabled():
        yield _NullTask()
        return
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        task_id = bar.add_task(description, total=total)

        class _Task:
            def advance(self, n: int = 1) -> None:
                bar.advance(task_id, n)

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
