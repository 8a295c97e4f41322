"""`spec plan`: memory, FLOPs, disk and GPU hours of a draft run for a target, before renting GPUs
(spec_cli.plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import Config
from spec_cli.help import DRAFT, INPUTS

HARDWARE = "Hardware"


def plan_algorithms() -> str:
    """--algorithm's help: the registered algorithms whose training step a plan can shape, and why not
    the others (spec_cli.plan.plannable)."""
    from spec_cli.draft.algorithms import ALGORITHMS  # (declarations only: no torch)
    from spec_cli.plan import plannable

    able = [f"{a.name} ({a.title})" for a in ALGORITHMS.values() if plannable(a) is None]
    not_able = [
        f"{a.title}: {plannable(a)}" for a in ALGORITHMS.values() if plannable(a) is not None
    ]
    return (
        f"The draft algorithm: {', '.join(able[:-1])} or {able[-1]}."
        if len(able) > 1
        else f"The draft algorithm: {able[0]}."
    ) + (f" Not planned: {'; '.join(not_able)}." if not_able else "")


def plan_cmd(
    target: Annotated[
        Path, typer.Argument(help="The target: a model folder, or just its config.json.")
    ],
    algorithm: Annotated[
        str, typer.Option("--algorithm", help=plan_algorithms(), rich_help_panel=DRAFT)
    ] = "eagle3",
    seq_len: Annotated[
        str,
        typer.Option(
            "--seq-len",
            help="Row lengths to plan, comma-separated (tokens per row, packed or not).",
            rich_help_panel=INPUTS,
        ),
    ] = "8192,32768",
    batch_size: Annotated[
        int,
        typer.Option("--batch-size", help="Rows per micro-batch per GPU.", rich_help_panel=INPUTS),
    ] = 1,
    draft_vocab_size: Annotated[
        int, typer.Option("--draft-vocab-size", rich_help_panel=DRAFT)
    ] = 32000,
    ttt_steps: Annotated[
        int | None,
        typer.Option(
            "--ttt-steps",
            help="As spec train's. Default: the --algorithm's (EAGLE-3 3; EAGLE-1/2, MSD, P-EAGLE 7).",
            min=1,
            rich_help_panel=DRAFT,
        ),
    ] = None,
    draft_layers: Annotated[int, typer.Option("--draft-layers", rich_help_panel=DRAFT)] = 1,
    block_size: Annotated[
        int,
        typer.Option(
            "--block-size",
            help="DFlash and DSpark: queries per block (as spec train's).",
            min=2,
            rich_help_panel=DRAFT,
        ),
    ] = 8,
    max_anchors: Annotated[
        int,
        typer.Option(
            "--max-anchors",
            help="DFlash and DSpark: blocks at this many slots a row (0: every slot).",
            min=0,
            rich_help_panel=DRAFT,
        ),
    ] = 0,
    markov_rank: Annotated[
        int,
        typer.Option(
            "--markov-rank", help="DSpark: the Markov head's rank.", min=1, rich_help_panel=DRAFT
        ),
    ] = 256,
    samples: Annotated[
        int, typer.Option("--samples", help="Training samples.", rich_help_panel=INPUTS)
    ] = 100_000,
    avg_tokens: Annotated[
        int, typer.Option("--avg-tokens", help="Mean tokens per sample.", rich_help_panel=INPUTS)
    ] = 1024,
    epochs: Annotated[float, typer.Option("--epochs", rich_help_panel=INPUTS)] = 1.0,
    gpus: Annotated[
        int, typer.Option("--gpus", help="GPUs the run uses (all nodes).", rich_help_panel=HARDWARE)
    ] = 8,
    gpu: Annotated[
        str,
        typer.Option(
            "--gpu",
            help="a100-40gb, a100, l40s, h100, h200, b200 or mi300x.",
            rich_help_panel=HARDWARE,
        ),
    ] = "h100",
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory", help="GB per GPU (overrides --gpu's).", rich_help_panel=HARDWARE
        ),
    ] = None,
    gpu_tflops: Annotated[
        float | None,
        typer.Option("--gpu-tflops", help="bf16 dense TFLOP/s per GPU.", rich_help_panel=HARDWARE),
    ] = None,
    utilization: Annotated[
        float,
        typer.Option(
            "--utilization", help="Fraction of the peak FLOP/s reached.", rich_help_panel=HARDWARE
        ),
    ] = 0.35,
    context_parallel: Annotated[
        int,
        typer.Option(
            "--context-parallel",
            help="Also plan each step with rows split over N ranks (spec train "
            "--context-parallel): memory and FLOPs per rank.",
            rich_help_panel=HARDWARE,
        ),
    ] = 1,
    precision: Annotated[
        str,
        typer.Option(
            "--precision",
            help="bf16: a GPU run (bf16 autocast, the target in bf16); fp32: a CPU run.",
            rich_help_panel=HARDWARE,
        ),
    ] = "bf16",
    target_engine: Annotated[
        str,
        typer.Option(
            "--target-engine",
            help="What runs a live target (spec train --target-engine): transformers (bf16, a "
            "quantized checkpoint counted dequantized) or vllm (the weights as stored, e.g. "
            "gpt-oss's mxfp4).",
            rich_help_panel=HARDWARE,
        ),
    ] = "transformers",
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="Also write the plan as JSON here.", rich_help_panel=INPUTS),
    ] = None,
    config: Config = None,
):
    """Plan a run: the draft's size, each step's peak memory per GPU and FLOPs (the real training step run
    on fake tensors at the target's shapes), the feature cache's disk and the GPU hours."""
    import json

    from spec_cli.artifacts import outputs
    from spec_cli.artifacts.io import write_json
    from spec_cli.errors import ConfigError
    from spec_cli.plan.report import PlanSettings, make_plan, show

    if json_out is not None:  # before the plan runs its steps
        outputs.check(
            {"--json": (json_out, outputs.PLAN)}, {"the target": target, "--config": config}
        )
    try:
        lengths = tuple(int(x) for x in seq_len.split(",") if x.strip())
    except ValueError:
        raise ConfigError(
            f"--seq-len {seq_len!r} is not a list of integers", "e.g. --seq-len 8192,32768"
        ) from None
    plan = make_plan(
        PlanSettings(
            target=target,
            algorithm=algorithm,
            seq_lens=lengths,
            batch_size=batch_size,
            draft_vocab_size=draft_vocab_size,
            ttt_steps=ttt_steps,
            draft_layers=draft_layers,
            block_size=block_size,
            max_anchors=max_anchors,
            markov_rank=markov_rank,
            samples=samples,
            avg_tokens=avg_tokens,
            epochs=epochs,
            gpus=gpus,
            gpu=gpu,
            gpu_memory=gpu_memory,
            gpu_tflops=gpu_tflops,
            utilization=utilization,
            precision=precision,
            context_parallel=context_parallel,
            target_engine=target_engine,
        )
    )
    show(plan)
    if json_out is not None:
        write_json(json_out, {"kind": "plan", **json.loads(plan.to_json())})
