"""`spec export`: a draft checkpoint as a folder a serving engine reads as is (spec_cli.stages.export)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import Config, Quiet
from spec_cli.console import set_quiet
from spec_cli.help import CHECKS, INPUTS


def export_cmd(
    source: Annotated[
        Path,
        typer.Argument(
            help="A run folder (RUN/best when training kept one with --keep best, else its latest checkpoint) or "
            "one of its checkpoints/step-* folders."
        ),
    ],
    format: Annotated[
        str,
        typer.Option(  # noqa: A002 (the option's name; YAML key `format`)
            "--format",
            "-f",
            help="vllm, sglang or speculators (vLLM's speculators format).",
            rich_help_panel=INPUTS,
        ),
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Export folder: new or empty, or an earlier export with --overwrite (built "
            "beside it, then renamed into place).",
            rich_help_panel=INPUTS,
        ),
    ],
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype", help="bf16, fp16 or fp32 for the float weights.", rich_help_panel=INPUTS
        ),
    ] = "bf16",
    check: Annotated[
        bool,
        typer.Option(
            "--check/--no-check",
            help="Read the export back with the engine's loading rules and compare its "
            "predictions with the checkpoint's before writing -o.",
            rich_help_panel=CHECKS,
        ),
    ] = True,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            "-t",
            help="Target path or hub id for the README's serving command (and the speculators "
            "verifier). Default: the target the run was trained with.",
            rich_help_panel=INPUTS,
        ),
    ] = None,
    engine_check: Annotated[
        str | None,
        typer.Option(
            "--engine-check",
            help="vllm: load the written folder in vLLM, decode a few greedy prompts and fail "
            "unless every draft weight loads and vLLM's acceptance matches the "
            "checkpoint's; none: skip. Default auto (env SPEC_ENGINE_CHECK): vllm when "
            "vLLM is installed, the format is vllm or speculators and the target is "
            "local.",
            rich_help_panel=CHECKS,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an earlier spec export in -o (without it, -o must be new or empty).",
            rich_help_panel=INPUTS,
        ),
    ] = False,
    allow_unsupported_target: Annotated[
        bool,
        typer.Option(
            "--allow-unsupported-target",
            help="Write the export although the engine (as spec_cli knows its "
            "version) cannot capture this target's aux hidden states; a "
            "warning instead of a refusal.",
            rich_help_panel=CHECKS,
        ),
    ] = False,
    config: Config = None,
    quiet: Quiet = False,
):
    """Export a draft checkpoint as a folder vLLM or SGLang serves as is (config.json,
    model.safetensors, README.md), checked by reading it back the way the engine does."""
    from spec_cli.console import summary
    from spec_cli.stages import export as stage

    set_quiet(quiet)
    result = stage.run(
        stage.ExportConfig(
            source=source,
            format=format,
            output=output,
            dtype=dtype,
            check=check,
            target=target,
            engine_check=engine_check,
            overwrite=overwrite,
            allow_unsupported_target=allow_unsupported_target,
        )
    )
    summary("export", result.summary_rows())
