"""`spec inspect`: what an artifact holds (spec_cli.ui)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import Config


def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="An artifact written by spec_cli.")],
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Feature cache: hash every shard against the manifest's checksums and "
            "name the damaged ones (exit 1 if any).",
        ),
    ] = False,
    config: Config = None,
):
    """Print what an artifact holds (vocab map, tokenised data, feature cache)."""
    from spec_cli.ui import inspect_artifact

    inspect_artifact(path, verify=verify)
