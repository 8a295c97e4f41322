"""How a command-line option is declared on a dataclass field, once: its flag names, help, --help
panel, checks and range, and the parsers for text such as `4G` or `45m`.

`spec train`'s options (spec_cli/train_options.py) and each draft algorithm's own options
(Algorithm.options) are fields made with `option(...)`; spec_cli/commands/train.py turns them into the
command's parameters. Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from spec_cli.errors import ConfigError


def parse_duration(text: str | None, option: str) -> float | None:
    """'90s', '45m', '1.5h' or a bare number of minutes -> seconds."""
    if text is None:
        return None
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    raw = text.strip().lower()
    scale = units.get(raw[-1:], None)
    number = raw[:-1] if scale is not None else raw
    try:
        value = float(number) * (scale or 60.0)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(
            f"{option} {text!r} is not a duration",
            "write e.g. 90s, 45m or 2h (a bare number is minutes)",
        )
    return value


def parse_size(text: str, option: str) -> int:
    """'512M', '4G', '1.5g', '65536' -> bytes (K/M/G/T are powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(raw[-1:], None)
    try:
        value = float(raw[:-1] if scale else raw) * (scale or 1)
    except ValueError:
        value = 0.0
    if not (value >= 1 and math.isfinite(value)):
        raise ConfigError(
            f"{option} {text!r} is not a size", "write e.g. 512M, 4G or a number of bytes"
        )
    return int(value)


def parse_size_or_auto(text: str, option: str) -> int | None:
    """'auto' -> None (the command sizes it), else a size as parse_size reads it."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_size(text, option)
    except ConfigError as err:
        raise ConfigError(
            err.message, "write auto, or a size such as 512M, 4G or a number of bytes"
        ) from None


@dataclass(frozen=True)
class Range:
    """The values a number option allows: finite, and within lo..hi (`open`: the bound itself excluded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def allows(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    @property
    def text(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return ""


POSITIVE = Range(0, lo_open=True)  # > 0
NON_NEGATIVE = Range(0)  # >= 0
FRACTION = Range(0, 1)  # [0, 1]


def check_range(name: str, value, allowed: Range | tuple[str, ...] | None) -> None:
    """Refuse (ConfigError naming the option and its range: one line, exit 1) a number option's value
    outside `allowed`; any float option must be finite (inf and nan are never a setting)."""
    if isinstance(allowed, tuple):  # a word option's choices
        if value is not None and value not in allowed:
            flag = "--" + name.replace("_", "-")
            choices = (
                ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
            )
            raise ConfigError(f"unknown {flag} {value!r}", f"use {choices}")
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    allowed = allowed or Range()
    if not allowed.allows(float(value)):
        flag = "--" + name.replace("_", "-")
        must = f"a finite number {allowed.text}".rstrip()
        raise ConfigError(f"{flag} {value:g} is out of range", f"{flag} must be {must}")


@dataclass(frozen=True)
class Flag:
    """How one option is written on the command line."""

    names: tuple[str, ...]  # "--output", "-o"; a pair of flags as "--on/--off"
    help: str
    panel: str  # its --help panel (spec_cli.help)
    parse: Callable[[str | None, str], object] | None = (
        None  # (text, option name) -> the field's value
    )
    text: str | None = None  # with `parse`: the default as a user writes it ("4G")
    checks: dict = field(
        default_factory=dict
    )  # typer.Option's own: min=, max=, envvar=, file_okay=


def option(
    default,
    *names: str,
    help: str,
    panel: str,
    parse=None,
    text: str | None = None,
    resumable: bool = False,
    allowed: Range | tuple[str, ...] | None = None,
    **checks,
):
    """A config field that is a `spec train` option. resumable: it may differ on --resume (it does not
        change the math: how long, how often, where from, on what). allowed: a number option's range (or a
    word option's choices, a tuple), checked
        by TrainConfig.from_options (a ConfigError naming the option: exit 1) and shown in --help; any float
        option must be finite."""
    if isinstance(allowed, tuple):
        help = f"{help} One of: {', '.join(allowed)}."
    elif allowed is not None:
        help = f"{help} Allowed: {allowed.text}."
    return field(
        default=default,
        metadata={
            "flag": Flag(names, help, panel, parse, text, checks),
            "resumable": resumable,
            "allowed": allowed,
        },
    )


def shared(default, resumable: bool = False):
    """A field whose option every stage that takes it shares: declared once, in spec_cli/commands/options.py."""
    return field(default=default, metadata={"flag": None, "resumable": resumable, "allowed": None})
