"""`spec precompute`: the feature cache the trainer reads (spec_cli.stages.precompute)."""

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
    NumProc,
    Quiet,
    Target,
    TargetEngine,
    TargetMemory,
    TargetTensorParallel,
    Threads,
    VocabMap,
)
from spec_cli.console import set_quiet
from spec_cli.help import DATA, INPUTS, RUNTIME


def precompute_cmd(
    target: Target,
    data: Data,
    vocab_map: VocabMap,
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="Feature cache folder to write.", rich_help_panel=INPUTS
        ),
    ],
    encoding: Annotated[
        str,
        typer.Option(
            "--encoding",
            help="hidden: aux + final hidden states (small; supervision rebuilt at load); "
            "probs: aux states + target probabilities over the draft vocab.",
            rich_help_panel=INPUTS,
        ),
    ] = "hidden",
    aux_layers: AuxLayers = None,
    algorithm: DraftAlgorithm = "eagle3",
    batch_tokens: Annotated[
        int,
        typer.Option(
            "--batch-tokens",
            help="Bound on B x padded length per target batch (length-bucketed).",
            min=1,
            rich_help_panel=RUNTIME,
        ),
    ] = 8192,
    shard_tokens: Annotated[
        int,
        typer.Option(
            "--shard-tokens",
            help="Real tokens per shard file (the unit of resume).",
            min=1,
            rich_help_panel=RUNTIME,
        ),
    ] = 65536,
    max_length: MaxLength = 2048,
    max_samples: Annotated[
        int | None,
        typer.Option(
            "--max-samples",
            help="Use only the first N usable samples. Default: all.",
            min=1,
            rich_help_panel=DATA,
        ),
    ] = None,
    num_proc: NumProc = 1,
    chat_template: ChatTemplate = None,
    device: Device = None,
    dtype: Dtype = None,
    storage_dtype: Annotated[
        str | None,
        typer.Option(
            "--storage-dtype",
            help="bf16, fp16 or fp32: the dtype the cache stores hidden states (and probs) "
            "in; training upcasts them. bf16 halves an fp32 cache. Default: the model "
            "dtype (--dtype).",
            rich_help_panel=RUNTIME,
        ),
    ] = None,
    target_engine: TargetEngine = "transformers",
    target_memory: TargetMemory = None,
    target_parallel: Annotated[
        str,
        typer.Option(
            "--target-parallel",
            help="Under torchrun: replica (the target whole on every rank), tensor (sharded "
            "over the machine's ranks by transformers' tensor-parallel plan: targets "
            "bigger than one GPU), or auto (tensor when its weights take over half a "
            "GPU).",
            rich_help_panel=RUNTIME,
        ),
    ] = "auto",
    target_tensor_parallel: TargetTensorParallel = 1,
    threads: Threads = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume/--no-resume",
            help="Keep verified shards of an interrupted run with the same inputs; "
            "--no-resume deletes the folder's cache and starts over.",
            rich_help_panel=INPUTS,
        ),
    ] = True,
    config: Config = None,
    quiet: Quiet = False,
):
    """Run the target over the data and write the feature cache the trainer reads (resumable;
    scales out with `torchrun --nproc-per-node N spec precompute ...`)."""
    from spec_cli.stages import precompute as stage
    from spec_cli.ui import print_precompute_summary

    set_quiet(quiet)
    result = stage.run(
        stage.PrecomputeConfig(
            target=target,
            data=data,
            vocab_map=vocab_map,
            output=output,
            encoding=encoding,
            aux_layers=aux_layers,
            algorithm=algorithm,
            batch_tokens=batch_tokens,
            shard_tokens=shard_tokens,
            max_length=max_length,
            max_samples=max_samples,
            num_proc=num_proc,
            device=device,
            dtype=dtype,
            storage_dtype=storage_dtype,
            resume=resume,
            target_engine=target_engine,
            threads=threads,
            target_memory=target_memory,
            target_parallel=target_parallel,
            target_tensor_parallel=target_tensor_parallel,
            chat_template=chat_template,
        )
    )
    print_precompute_summary(result)
