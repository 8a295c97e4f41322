"""The `spec` command: builds the app from the commands in spec_cli/commands/ (one module each, their
shared options in spec_cli/commands/options.py) and maps errors to one line and an exit code."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.markup import escape

from spec_cli import __version__, stopping
from spec_cli.commands import train
from spec_cli.commands.assets import assets_cmd
from spec_cli.commands.build_vocab_map import build_vocab_map_cmd
from spec_cli.commands.demo import demo_cmd
from spec_cli.commands.eval import eval_cmd
from spec_cli.commands.export import export_cmd
from spec_cli.commands.inspect import inspect_cmd
from spec_cli.commands.plan import plan_cmd
from spec_cli.commands.precompute import precompute_cmd
from spec_cli.commands.regenerate import regenerate_cmd
from spec_cli.commands.serve_target import serve_target_cmd
from spec_cli.commands.tune import tune_cmd
from spec_cli.console import err_console, other_rank
from spec_cli.errors import SpecError, is_disk_full
from spec_cli.help import Command, Group
from spec_cli.paths import special_kind


def _print_version(value: bool) -> None:
    if value:
        print(f"spec_cli {__version__}")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version.", is_eager=True, callback=_print_version
        ),
    ] = False,
):
    pass


def build_app() -> typer.Typer:
    """The `spec` app with every command, in --help order. main() builds it on each call, so `train`
    has the options declared at that moment (spec_cli/commands/train.py)."""
    app = typer.Typer(
        name="spec",
        cls=Group,
        help="Train speculative-decoding drafts (EAGLE-3, EAGLE-1/2, P-EAGLE, DFlash, DSpark, MSD) "
        "for a target LLM, export them for vLLM/SGLang, and measure how to serve them.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    commands = [
        ("assets", assets_cmd),
        ("regenerate", regenerate_cmd),
        ("build-vocab-map", build_vocab_map_cmd),
        ("precompute", precompute_cmd),
        ("train", train.command()),
        ("export", export_cmd),
        ("eval", eval_cmd),
        ("tune", tune_cmd),
        ("serve-target", serve_target_cmd),
        ("demo", demo_cmd),
        ("inspect", inspect_cmd),
        ("plan", plan_cmd),
    ]
    for name, function in commands:
        app.command(name, cls=Command)(function)
    return app


# ----------------------------------------------------------------------------- entry point


def _quiet_libraries() -> None:
    """transformers/datasets print their own progress bars and advice; spec prints its own."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stopped_line(stop: stopping.Stopped) -> str:
    """The last line of a command a signal stopped (spec_cli/stopping.py)."""
    return (
        f"stopped ({stop.name}); finished work is kept: rerun the same command to continue (regenerate "
        "and precompute go on where they stopped, train with --resume)"
    )


def _say_stopped(stop: stopping.Stopped) -> None:
    """The stopped line, from rank 0 alone under torchrun (every rank stopped alike)."""
    if not other_rank():
        err_console.print(stopped_line(stop), soft_wrap=True)


_PATH_MISTAKES = {
    FileExistsError: "already exists; pass a path that does not exist yet, or remove it",
    IsADirectoryError: "is a folder where a file is expected; pass a file path",
    NotADirectoryError: "is a file where a folder is expected (or one of its parents is a file); pass a folder path",
    PermissionError: "is not writable (or readable) by you; pass a path you may write, or fix its permissions",
    FileNotFoundError: "does not exist; check the path (a folder above it may be missing)",
}


def _is_path_mistake(exc: OSError) -> bool:
    """A filesystem error about a named path: the user's path, not a bug (ENOSPC and EROFS count too)."""
    return bool(exc.filename) and (
        type(exc) in _PATH_MISTAKES or exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
    )


def _path_mistake(exc: OSError) -> str:
    """One line naming the path and what to do about it."""
    if not exc.filename:  # a full disk under a write that named no file
        return (
            "no space left on a device this command writes to; free space or write elsewhere, then rerun "
            "the same command"
        )
    existing = next(
        (q for q in (Path(exc.filename), *Path(exc.filename).parents) if q.exists()), None
    )
    special = special_kind(existing) if existing is not None else None
    if special:  # /dev/full/x: never advise removing a device
        where = "" if existing == Path(exc.filename) else f" (in {exc.filename})"
        return f"{existing}{where} is {special}, not a folder or a regular file; pass another path"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device holding {exc.filename}; free space or write elsewhere"
    if exc.errno == errno.EROFS:
        return f"{exc.filename} is on a read-only file system; write elsewhere"
    if isinstance(exc, FileExistsError) and Path(exc.filename).is_file():  # mkdir over a file
        return f"{exc.filename} {_PATH_MISTAKES[NotADirectoryError]}"
    return f"{exc.filename} {_PATH_MISTAKES[type(exc)]}"


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: one line per user error (traceback only with SPEC_DEBUG=1)."""
    debug = os.environ.get("SPEC_DEBUG", "") not in ("", "0")
    _quiet_libraries()
    with stopping.sigterm_as_ctrl_c():  # a scheduler's stop is Ctrl-C's: finished work kept
        return _main(argv, debug)


def _main(argv: list[str] | None, debug: bool) -> int:
    try:
        result = build_app()(args=argv, prog_name="spec", standalone_mode=False)
        if result == 130:  # typer answers any KeyboardInterrupt with a bare exit code 130
            stop = stopping.last_stop()
            _say_stopped(stop)
            return stop.exit_code
        return result if isinstance(result, int) else 0
    except Exception as exc:
        stop = stopping.in_chain(exc)  # a library turned the stop into an error of its own
        if stop is None:
            return _error(exc, debug)
        stop = stop if isinstance(stop, stopping.Stopped) else stopping.last_stop()
        _say_stopped(stop)
        return stop.exit_code
    except (click.exceptions.Abort, typer.Abort, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, stopping.Stopped) else stopping.last_stop()
        _say_stopped(stop)
        return stop.exit_code


def _error(exc: Exception, debug: bool) -> int:
    """An error that ended the command: one line and its exit code."""
    try:
        raise exc
    except SpecError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(exc.one_line())}", soft_wrap=True)
        return 1
    except (click.exceptions.Exit, typer.Exit) as exc:
        return exc.exit_code
    except (
        click.ClickException,
        typer.TyperException,
    ) as exc:  # typer >= 0.2x raises its own click's
        exc.show()
        return exc.exit_code
    except OSError as exc:  # a path the user gave that cannot be used as asked is theirs to fix
        if debug:
            raise
        if _is_path_mistake(exc) or is_disk_full(exc):
            err_console.print(f"[bold red]error:[/] {escape(_path_mistake(exc))}", soft_wrap=True)
            return 1
        return _internal_error(exc)
    except Exception as exc:  # a bug: say so in one line unless debugging
        if debug:
            raise
        if is_disk_full(exc):  # a write no artifact writer wrapped (a lock file's pid, a log line)
            err_console.print(
                "[bold red]error:[/] no space left on a device this command writes to "
                f"({escape(str(exc))}); free space or write elsewhere, then rerun the same "
                "command",
                soft_wrap=True,
            )
            return 1
        return _internal_error(exc)


def _internal_error(exc: BaseException) -> int:
    err_console.print(
        f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} "
        "(rerun with SPEC_DEBUG=1 for the traceback and report it)",
        soft_wrap=True,
    )
    return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
