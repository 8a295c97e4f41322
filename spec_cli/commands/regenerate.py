"""`spec regenerate`: the target answers the data's user turns itself (spec_cli.stages.regenerate)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import (
    AuxLayers,
    ChatTemplate,
    Config,
    Data,
    Device,
    DraftAlgorithm,
    Dtype,
    MaxLength,
    Quiet,
    Target,
    Threads,
)
from spec_cli.console import set_quiet
from spec_cli.help import DATA, DRAFT, GENERATION, INPUTS, RUNTIME


def regenerate_cmd(
    target: Target,
    data: Data,
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Chat data file to write (.jsonl), with OUT.meta.json (provenance) beside it.",
            rich_help_panel=INPUTS,
        ),
    ],
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature",
            help="0: greedy; > 0: sampled, each answer from its own generator seeded by "
            "(--seed, record, turn), so reruns and resumes give the same file.",
            min=0.0,
            rich_help_panel=GENERATION,
        ),
    ] = 0.0,
    top_p: Annotated[
        float,
        typer.Option(
            "--top-p",
            help="Sample from the most probable ids holding this much probability (1: all).",
            min=0.0,
            max=1.0,
            rich_help_panel=GENERATION,
        ),
    ] = 1.0,
    seed: Annotated[
        int,
        typer.Option(
            "--seed", help="Seed for sampling (temperature > 0).", rich_help_panel=GENERATION
        ),
    ] = 0,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens",
            help="Tokens per answer at most; an answer cut there is marked "
            'finish_reason "length" and ends its conversation.',
            min=1,
            rich_help_panel=GENERATION,
        ),
    ] = 512,
    max_length: MaxLength = 2048,
    max_samples: Annotated[
        int | None,
        typer.Option(
            "--max-samples",
            help="Answer only the first N usable records. Default: all.",
            min=1,
            rich_help_panel=DATA,
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            help="Sequences per generation batch at most (vLLM: sequences it runs at once). "
            "Default: as --batch-tokens allows.",
            min=1,
            rich_help_panel=RUNTIME,
        ),
    ] = None,
    batch_tokens: Annotated[
        int,
        typer.Option(
            "--batch-tokens",
            help="transformers: bound on B x (padded prompt + new tokens) per batch "
            "(length-sorted).",
            min=1,
            rich_help_panel=RUNTIME,
        ),
    ] = 16384,
    chunk_size: Annotated[
        int,
        typer.Option(
            "--chunk-size",
            help="Records per part file (the unit of resume).",
            min=1,
            rich_help_panel=RUNTIME,
        ),
    ] = 128,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="transformers or vllm (the `vllm` extra): what runs the target.",
            rich_help_panel=RUNTIME,
        ),
    ] = "transformers",
    device: Device = None,
    dtype: Dtype = None,
    threads: Threads = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an -o made from other inputs or settings (or an unfinished run of "
            "them) instead of refusing.",
            rich_help_panel=INPUTS,
        ),
    ] = False,
    chat_template: ChatTemplate = None,
    features: Annotated[
        Path | None,
        typer.Option(
            "--features",
            help="Also write the feature cache of the output to this folder (vLLM): from the states "
            "vLLM computes while it answers, so the target does not run the text again in spec "
            "precompute. The same cache as `spec precompute -d OUT` with these settings.",
            rich_help_panel=INPUTS,
        ),
    ] = None,
    vocab_map: Annotated[
        Path | None,
        typer.Option(
            "--vocab-map",
            "-v",
            help="With --features: the cache's vocab map; a path that does not exist yet "
            "gets the one built from the output (as spec build-vocab-map would).",
            rich_help_panel=INPUTS,
        ),
    ] = None,
    draft_vocab_size: Annotated[
        int,
        typer.Option(
            "--draft-vocab-size",
            help="With --features: the vocab map's size when it is built from the output.",
            min=1,
            rich_help_panel=DRAFT,
        ),
    ] = 32000,
    algorithm: DraftAlgorithm = "eagle3",
    aux_layers: AuxLayers = None,
    config: Config = None,
    quiet: Quiet = False,
):
    """Let the target answer every user turn of the data itself (turn by turn, after its own earlier
    answers) and write the conversations as chat data for the other stages (resumable)."""
    from spec_cli.stages import regenerate as stage
    from spec_cli.ui import print_regenerate_summary

    set_quiet(quiet)
    result = stage.run(
        stage.RegenerateConfig(
            target=target,
            data=data,
            output=output,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            max_new_tokens=max_new_tokens,
            max_length=max_length,
            max_samples=max_samples,
            batch_size=batch_size,
            batch_tokens=batch_tokens,
            chunk_size=chunk_size,
            engine=engine,
            device=device,
            dtype=dtype,
            threads=threads,
            overwrite=overwrite,
            chat_template=chat_template,
            features=features,
            vocab_map=vocab_map,
            draft_vocab_size=draft_vocab_size,
            algorithm=algorithm,
            aux_layers=aux_layers,
        )
    )
    print_regenerate_summary(result)
