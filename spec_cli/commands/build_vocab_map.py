"""`spec build-vocab-map`: the draft vocab map from the data's supervised tokens (spec_cli.stages.build_vocab_map)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import ChatTemplate, Config, Data, MaxLength, NumProc, Quiet, Target
from spec_cli.console import set_quiet
from spec_cli.help import DRAFT, INPUTS


def build_vocab_map_cmd(
    target: Target,
    data: Data,
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="Vocab map file to write (.safetensors).", rich_help_panel=INPUTS
        ),
    ],
    draft_vocab_size: Annotated[
        int,
        typer.Option(
            "--draft-vocab-size",
            help="Draft vocabulary size Vd (the most frequent supervised ids).",
            rich_help_panel=DRAFT,
        ),
    ] = 32000,
    max_length: MaxLength = 2048,
    num_proc: NumProc = 1,
    chat_template: ChatTemplate = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace a vocab map at -o made from other inputs or settings (without it, only one "
            "made from the same inputs and settings is rewritten). Nothing but a vocab map is "
            "ever replaced.",
            rich_help_panel=INPUTS,
        ),
    ] = False,
    config: Config = None,
    quiet: Quiet = False,
):
    """Count supervised target tokens in the data and write the draft vocab map (d2t, t2d)."""
    from spec_cli.stages import build_vocab_map as stage
    from spec_cli.ui import print_vocab_map_summary

    set_quiet(quiet)
    result = stage.run(
        stage.BuildVocabMapConfig(
            target=target,
            data=data,
            output=output,
            draft_vocab_size=draft_vocab_size,
            max_length=max_length,
            num_proc=num_proc,
            chat_template=chat_template,
            force=force,
        )
    )
    print_vocab_map_summary(result)
