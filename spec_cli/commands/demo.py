"""`spec demo`: the whole pipeline on the built-in SmolLM2 target (spec_cli.stages.demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import Device, Dtype, Quiet
from spec_cli.console import set_quiet
from spec_cli.train_options import parse_duration


def demo_cmd(
    minutes: Annotated[
        float | None,
        typer.Option(
            "--minutes",
            help="How long the demo may take (default 30). Before its first stage it measures this "
            "machine's speed and sizes the target's answers and the training steps to end near "
            "that: more minutes buy more of both, and a better draft. It says what twice the "
            "minutes would buy here. Each budget has its own default folder.",
            show_default=False,
        ),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="The pipeline's smoke test: every stage on a fixed small amount of work (not sized "
            "to minutes; the demo prints this machine's estimate before it starts).",
        ),
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Demo folder. Default: SPEC_HOME/demo/full (full-<M>min for another --minutes; "
            "quick with --quick).",
        ),
    ] = None,
    no_install: Annotated[
        bool,
        typer.Option(
            "--no-install", help="Only find the built-in assets; fail instead of pip-installing."
        ),
    ] = False,
    max_time: Annotated[
        str | None,
        typer.Option(
            "--max-time",
            help="Stop training after this long (90s, 10m, 1h; a number is minutes). The draft "
            "is then weaker, and the final table says so; a rerun finishes the schedule. "
            "To make the whole demo shorter, use --minutes instead: it trains fewer steps "
            "on purpose, with a schedule that ends.",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="What runs the target in regenerate, in the training loop's evaluations and in the "
            "closing `spec tune`: auto (vLLM where the `vllm` extra is installed, else "
            "transformers / spec_cli's PyTorch decoder), transformers or vllm.",
        ),
    ] = "auto",
    device: Device = None,
    dtype: Dtype = None,
    quiet: Quiet = False,
):
    """The whole pipeline on the built-in SmolLM2 target, in --minutes (default 30): assets,
    regenerate (SmolLM2 answers ShareGPT prompts itself, as many as the minutes buy on this machine;
    with vLLM installed the feature cache is kept as it answers, one pass of the target per answer),
    build-vocab-map, precompute, train (about four passes over the answers; the checkpoint that
    accepts best in the engine is kept), export it for vLLM (self-checked), eval on MT-bench and on
    held-out ShareGPT prompts, and tune how to serve it (spec tune). CPUs differ by more than 2x, so
    before its first stage the demo times this machine's speeds (about 15 s), sizes the answers and
    steps from them, and sizes the steps again once the answers are made. Regenerate and precompute
    run the target in bf16 where that is native (a GPU; a CPU with AMX or AVX512-BF16), else as
    --dtype says. Rerunning reuses finished stages and the run's sizing (times per CPU:
    docs/results.md)."""
    from spec_cli.stages import demo as stage
    from spec_cli.ui import print_demo_summary

    set_quiet(quiet)
    result = stage.run(
        stage.DemoConfig(
            quick=quick,
            minutes=minutes,
            output=output,
            install=not no_install,
            device=device,
            dtype=dtype,
            engine=engine,
            max_time=parse_duration(max_time, "--max-time"),
        )
    )
    print_demo_summary(result)
