"""The draft algorithms spec_cli trains, evaluates and exports, by name (`--algorithm`)."""

from __future__ import annotations

from spec_cli.draft.algorithm import Algorithm
from spec_cli.draft.dflash import DFLASH
from spec_cli.draft.dspark import DSPARK
from spec_cli.draft.eagle import EAGLE
from spec_cli.draft.eagle3 import EAGLE3
from spec_cli.draft.msd import MSD
from spec_cli.draft.peagle import PEAGLE
from spec_cli.errors import ConfigError

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (EAGLE3, EAGLE, PEAGLE, DFLASH, DSPARK, MSD)}
DEFAULT = "eagle3"


def get(name: str | None) -> Algorithm:
    """The algorithm called `name` (None: the default), or a ConfigError listing the known ones."""
    name = name or DEFAULT
    if name not in ALGORITHMS:
        raise ConfigError(
            f"unknown draft algorithm {name!r}", f"use one of {', '.join(ALGORITHMS)}"
        )
    return ALGORITHMS[name]
