"""`spec demo`: the whole pipeline on the built-in SmolLM2 target (spec_cli.stages.demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import Device, Dtype, Quiet
from spec_cli.console import set_quiet
from spec_cli.train_options import parse_duration


def demo_cmd(
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="A smaller run that exercises every stage (about a fifth of the default's time; the "
            "demo prints this machine's estimate before it starts).",
        ),
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Demo folder. Default: SPEC_HOME/demo/full (or /quick)."
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
            "Default: no cap (the schedule is fixed in steps, so the result does not depend "
            "on the machine's speed).",
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
    """The whole pipeline on the built-in SmolLM2 target: assets, regenerate (SmolLM2 answers the
    ShareGPT prompts itself; with vLLM installed it answers 1,100 and the feature cache is kept as it
    answers, one pass of the target per answer; without, it answers 320 and 1,300 further ShareGPT
    conversations are trained on as written), build-vocab-map, precompute, train (a fixed number of
    steps; the checkpoint that accepts best in the engine is kept), export it for vLLM (self-checked),
    eval on MT-bench and on held-out ShareGPT prompts, and tune how to serve it (spec tune). Regenerate
    and precompute run the target in bf16 where that is native (a GPU; a CPU with AMX or AVX512-BF16),
    else as --dtype says. Rerunning reuses finished stages. How long it takes depends on the CPU by more
    than 2x, so before its first stage the demo times this machine's speeds (about 15 s) and prints
    its own estimate (times per CPU: docs/results.md)."""
    from spec_cli.stages import demo as stage
    from spec_cli.ui import print_demo_summary

    set_quiet(quiet)
    result = stage.run(
        stage.DemoConfig(
            quick=quick,
            output=output,
            install=not no_install,
            device=device,
            dtype=dtype,
            engine=engine,
            max_time=parse_duration(max_time, "--max-time"),
        )
    )
    print_demo_summary(result)
