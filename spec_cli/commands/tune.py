"""`spec tune`: the speculation length per batch size that serves a draft fastest here (spec_cli.stages.tune)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import Config, Device, Dtype, Quiet, Target
from spec_cli.console import set_quiet
from spec_cli.help import DECODING, INPUTS, RUNTIME


def tune_cmd(
    draft: Annotated[
        Path,
        typer.Argument(
            help="A `spec export` folder (vLLM's format for --engine vllm), or a run / checkpoint folder (exported "
            "for vLLM on the fly)."
        ),
    ],
    target: Target,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Folder for serving.json and speedup.png. Default: EXPORT-tune beside the export.",
            rich_help_panel=INPUTS,
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="vllm: tokens/s of vLLM with 0..--max-k draft tokens at each batch size, and the "
            "num_speculative_tokens_per_batch_size schedule that was fastest; torch: spec_cli's "
            "decoder at batch 1, chains and EAGLE-2 trees.",
            rich_help_panel=RUNTIME,
        ),
    ] = "vllm",
    max_k: Annotated[
        int | None,
        typer.Option(
            "--max-k",
            help="Draft tokens per step tried: 1 .. this (and none). Default 5; a DFlash draft: its "
            "block size - 1.",
            min=1,
            rich_help_panel=DECODING,
        ),
    ] = None,
    batch_sizes: Annotated[
        str | None,
        typer.Option(
            "--batch-sizes",
            help="Concurrent requests measured, comma-separated. Default: 1,2,4,8,16, those the "
            "engine's KV cache holds.",
            rich_help_panel=DECODING,
        ),
    ] = None,
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            "-p",
            help="`mt-bench` or a chat data file: the first user turn of each record.",
            rich_help_panel=INPUTS,
        ),
    ] = "mt-bench",
    requests: Annotated[
        int,
        typer.Option(
            "--requests",
            help="Prompts decoded at every batch size (in waves of the batch size; the batch size "
            "when it is larger).",
            min=1,
            rich_help_panel=DECODING,
        ),
    ] = 8,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens",
            help="Tokens generated per request at most.",
            min=1,
            rich_help_panel=DECODING,
        ),
    ] = 64,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            help="Times every configuration is measured, in turn; each keeps its median and range.",
            min=1,
            rich_help_panel=RUNTIME,
        ),
    ] = 3,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            help="Start vLLM with the recommended speculative_config and check that its "
            "greedy outputs equal the target alone's.",
            rich_help_panel=RUNTIME,
        ),
    ] = True,
    fingerprint_check: Annotated[
        bool,
        typer.Option(
            "--fingerprint-check/--no-fingerprint-check",
            help="Refuse a draft whose recorded target/tokenizer fingerprint is not this target's.",
            rich_help_panel=INPUTS,
        ),
    ] = True,
    device: Device = None,
    dtype: Dtype = None,
    config: Config = None,
    quiet: Quiet = False,
):
    """Measure how to serve a draft on this machine: output tokens/s with 0 .. --max-k draft tokens at each
    batch size (vLLM), and write the speculative_config that was fastest (serving.json)."""
    from spec_cli.stages import tune as stage

    set_quiet(quiet)
    result = stage.run(
        stage.TuneConfig(
            draft=draft,
            target=target,
            output=output,
            engine=engine,
            max_k=max_k,
            batch_sizes=parse_sizes(batch_sizes),
            prompts=prompts,
            requests=requests,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            dtype=dtype,
            device=device,
            check_fingerprint=fingerprint_check,
            verify=verify,
        )
    )
    stage.print_tune(result)


def parse_sizes(text: str | None) -> tuple[int, ...] | None:
    """ "1,2,4" -> (1, 2, 4); a bad list is one clear error."""
    from spec_cli.errors import ConfigError

    if not text:
        return None
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ConfigError(
            f"--batch-sizes {text!r} is not a list of whole numbers", "e.g. --batch-sizes 1,2,4,8"
        ) from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"--batch-sizes {text!r}: a batch size is at least 1", "e.g. --batch-sizes 1,2,4,8"
        )
    return sizes
