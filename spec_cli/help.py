"""`spec --help` and `spec COMMAND --help`: the options in named panels, laid out so that nothing a
user must copy is cut at 80 columns.

typer's own layout gives the long names, the short names, the negative names, the value's type and
the help a column each, and shrinks them all together on a narrow terminal: at 80 columns it cuts
names (`--stream-max-by…`), and it marks every flag `<bool>` although a flag takes no value. Here
a panel is a table of two columns: the names with what a value option takes (`--lr FLOAT`), never
wrapped, and the help, which wraps in the width that is left."""

from __future__ import annotations

import inspect

from rich.console import Console
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

# The panels, in the order --help shows them. An option given none is in OPTIONS.
ARGUMENTS = "Arguments"
INPUTS = "Inputs and output"
TARGET = "Live target"
DATA = "Data"
GENERATION = "Generation"
DRAFT = "Draft"
OBJECTIVE = "Objective"
OPTIMISATION = "Optimisation"
CHECKPOINTS = "Checkpoints & logging"
ENGINE_LOOP = "Engine in the loop"
DECODING = "Decoding"
CHECKS = "Checks"
SERVER = "Server"
LIMITS = "Request limits"
RUNTIME = "Runtime"
OPTIONS = "Options"
ORDER = (
    ARGUMENTS,
    INPUTS,
    TARGET,
    DATA,
    GENERATION,
    DRAFT,
    OBJECTIVE,
    OPTIMISATION,
    CHECKPOINTS,
    ENGINE_LOOP,
    DECODING,
    CHECKS,
    SERVER,
    LIMITS,
    RUNTIME,
    OPTIONS,
)

_ONE_LINE = 28  # `--x / --no-x` longer than this puts `/ --no-x` on a line of its own
_GAP, _EDGES = 2, 4  # between the two columns; a panel's borders and padding


class Command(TyperCommand):
    """A `spec` command whose --help is `print_help`'s."""

    def format_help(self, ctx, formatter) -> None:
        print_help(self, ctx)

    def collect_usage_pieces(self, ctx) -> list[str]:
        """`[OPTIONS] TARGET`: arguments as click writes them (typer >= 0.29 writes `{target}`)."""
        return [
            self.options_metavar,
            *(_argument(p) for p in self.get_params(ctx) if p.param_type_name == "argument"),
        ]


def _argument(param) -> str:
    """An argument's name on the usage line and in its panel: TARGET, [TARGET] when optional."""
    name = param.metavar or param.name.upper()
    name += "..." if param.nargs != 1 else ""
    return name if param.required else f"[{name}]"


class Group(TyperGroup):
    """The `spec` group, whose --help is `print_help`'s."""

    def format_help(self, ctx, formatter) -> None:
        print_help(self, ctx)


def print_help(command, ctx) -> None:
    """Usage, the command's help, its options panel by panel, and a group's commands."""
    console = Console(highlight=False)  # made now: the terminal's width, or $COLUMNS
    console.print(Padding(Text(command.get_usage(ctx), style="bold"), (1, 1, 0, 1)))
    if command.help:
        console.print(Padding(_prose(command.help), (1, 1, 0, 1)))
    console.print()
    panels: dict[str, list] = {}
    for param in command.get_params(ctx):
        if not getattr(param, "hidden", False):
            panels.setdefault(_panel_of(param), []).append(param)
    for title in sorted(panels, key=lambda t: ORDER.index(t) if t in ORDER else len(ORDER)):
        names = [_names(p, ctx) for p in panels[title]]
        width = max(
            console.width - _EDGES - _GAP - max(line.cell_len for n in names for line in n.split()),
            20,
        )
        console.print(
            _panel(title, [(n, _help(p, console, width)) for n, p in zip(names, panels[title])])
        )
    if isinstance(command, TyperGroup):
        subcommands = [command.get_command(ctx, name) for name in command.list_commands(ctx)]
        console.print(
            _panel(
                "Commands",
                [
                    (Text(c.name, style="bold cyan"), _prose(c.help or "", first=True))
                    for c in subcommands
                    if c is not None and not c.hidden
                ],
            )
        )


def _panel(title: str, rows: list[tuple[Text, Text]]) -> Panel:
    table = Table.grid(padding=(0, _GAP))
    table.add_column(no_wrap=True)  # the names: never wrapped, so never cut
    table.add_column(overflow="fold")  # the help takes what is left
    for row in rows:
        table.add_row(*row)
    return Panel(table, title=title, title_align="left", border_style="dim")


def _panel_of(param) -> str:
    default = ARGUMENTS if param.param_type_name == "argument" else OPTIONS
    return getattr(param, "rich_help_panel", None) or default


def _prose(text: str, first: bool = False) -> Text:
    """A docstring's paragraphs (or the first), each joined into one line for rich to wrap."""
    paragraphs = inspect.cleandoc(text).partition("\f")[0].split("\n\n")
    return Text("\n\n".join(" ".join(p.split()) for p in paragraphs[: 1 if first else None]))


def _long_first(names: list[str]) -> list[str]:
    return sorted(names, key=lambda name: not name.startswith("--"))


def _names(param, ctx) -> Text:
    """`--target, -t TEXT`, `--resume / --no-resume`, `--fsdp`; an argument as the usage line has it."""
    if param.param_type_name == "argument":
        return Text(_argument(param), style="bold cyan")
    text = Text(", ".join(_long_first(param.opts)), style="bold cyan")
    if param.secondary_opts:
        off = ", ".join(_long_first(param.secondary_opts))
        text.append(" / " if len(text) + 3 + len(off) <= _ONE_LINE else "\n/ ")
        text.append(off, style="bold magenta")
    elif not getattr(param, "is_flag", False):
        text.append(f" {_metavar(param)}", style="yellow")
    return text


def _metavar(param) -> str:
    """What a value option takes: INT, FLOAT, PATH or TEXT (from its Python type)."""
    if param.metavar:
        return param.metavar
    kind = getattr(getattr(param, "type_descriptor", None), "annotation", None)  # typer >= 0.2x
    name = (
        kind.__name__
        if isinstance(kind, type)
        else getattr(getattr(param, "type", None), "name", "")
    )  # click
    return {"int": "INT", "integer": "INT", "float": "FLOAT", "path": "PATH"}.get(
        (name or "text").split()[0].lower(), "TEXT"
    )


def _default(param) -> object | None:
    """The value in force when the option is not given; None where there is nothing to say."""
    if (
        param.param_type_name != "option"
        or param.required
        or getattr(param, "show_default", True) is False
    ):
        return None
    if getattr(
        param, "is_flag", False
    ):  # a plain flag is off unless given; `--x/--no-x` names its default
        chosen = param.opts if param.default else param.secondary_opts
        return _long_first(chosen)[0] if param.secondary_opts else None
    return param.default


def _help(param, console: Console, width: int) -> Text:
    """The help, then its notes (`[default: 2048]`, `[required]`), each on one line: after the help's
    last line where it fits in `width`, else on a line of its own."""
    text = Text(" ".join((param.help or "").split()))
    default, envvar = _default(param), getattr(param, "envvar", None)
    notes = (
        ([f"[default: {default}]"] if default is not None else [])
        + ([f"[env var: {envvar}]"] if envvar and getattr(param, "show_envvar", True) else [])
        + (["[required]"] if param.required else [])
    )
    for note in notes:
        if text:
            fits = text.wrap(console, width)[-1].cell_len + 2 + len(note) <= width
            text.append("  " if fits else "\n")
        text.append(note, style="dim")
    return text
