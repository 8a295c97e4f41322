"""The options several commands share, each declared once as an `Annotated` type.

Each sits in the --help panel it belongs to (spec_cli.help); `in_panel` shows one in another.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, get_args

import typer

from spec_cli.config import apply_config_file
from spec_cli.help import DATA, INPUTS, RUNTIME

Config = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="YAML file of option values (keys are option names); flags win over it.",
        is_eager=True,
        callback=apply_config_file,
        exists=False,
        dir_okay=False,
    ),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or summary.")]
Target = Annotated[
    str,
    typer.Option(
        "--target",
        "-t",
        help="Target model: a transformers folder, a .gguf file, or `smollm2` (built-in).",
        rich_help_panel=INPUTS,
    ),
]
Data = Annotated[
    str,
    typer.Option(
        "--data",
        "-d",
        help="Chat data: .jsonl/.json/.parquet, a saved `datasets` folder, or `sharegpt` "
        "(built-in). ShareGPT `conversations`, OpenAI `messages`, or plain `text`.",
        rich_help_panel=INPUTS,
    ),
]
MaxLength = Annotated[
    int,
    typer.Option(
        "--max-length",
        help="Truncate each conversation to this many tokens.",
        min=2,
        rich_help_panel=DATA,
    ),
]
NumProc = Annotated[
    int,
    typer.Option(
        "--num-proc",
        help="Processes for tokenising (results do not depend on it).",
        min=1,
        rich_help_panel=DATA,
    ),
]
VocabMap = Annotated[
    Path,
    typer.Option(
        "--vocab-map",
        "-v",
        help="Vocab map written by `spec build-vocab-map`.",
        rich_help_panel=INPUTS,
    ),
]
AuxLayers = Annotated[
    str | None,
    typer.Option(
        "--aux-layers",
        help="The target layers the draft reads (EAGLE-3: three), as 0-indexed layer OUTPUTS "
        "(e.g. 1,14,26). Default: the algorithm's; EAGLE-3: 1, N//2-1, N-4 for an "
        "N-layer target.",
        rich_help_panel=INPUTS,
    ),
]


def algorithm_help() -> str:
    """--algorithm's help: each registered algorithm by name, title and summary (spec_cli/draft/algorithms.py)."""
    from spec_cli.draft.algorithms import ALGORITHMS  # (declarations only: no torch)

    names = [
        f"{a.name} ({a.title}{', ' + a.summary if a.summary else ''})" for a in ALGORITHMS.values()
    ]
    listed = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    return (
        f"The draft algorithm: {listed}. It decides how many target layers are captured and which by "
        "default (--aux-layers)."
    )


DraftAlgorithm = Annotated[
    str, typer.Option("--algorithm", help=algorithm_help(), rich_help_panel=INPUTS)
]
Device = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="cpu, cuda or cuda:N. Default: cuda if available, else cpu.",
        rich_help_panel=RUNTIME,
    ),
]
Dtype = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="bf16, fp16 or fp32. Default: bf16 on cuda, fp32 on cpu.",
        rich_help_panel=RUNTIME,
    ),
]
Threads = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="Intra-op CPU threads. Default: auto, the cores this process may use less those "
        "other processes keep busy (OMP_NUM_THREADS if set); recorded with the result.",
        min=1,
        rich_help_panel=RUNTIME,
    ),
]
ChatTemplate = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        help="Render conversations with this chat template instead of the target's own: a "
        "Jinja file (or a tokenizer_config.json holding one), or a family: chatml, "
        "llama3, gemma, mistral. Needed for a base model without one; recorded in "
        "every artifact made from it.",
        rich_help_panel=DATA,
    ),
]
TargetEngine = Annotated[
    str,
    typer.Option(
        "--target-engine",
        help="transformers or vllm (the `vllm` extra): what runs a live target. The "
        "supervision is the same either way (fp32 rounding), and so is the identity "
        "of what it makes.",
        rich_help_panel=RUNTIME,
    ),
]

TargetMemory = Annotated[
    float | None,
    typer.Option(
        "--target-memory",
        help="--target-engine vllm on a GPU: the share of its memory vLLM may take for the "
        "target's weights and KV cache (its gpu_memory_utilization), in (0, 1]. "
        "Default: 0.5 in spec train (the draft trains on the same GPU), else vLLM's "
        "own (0.9).",
        min=0.01,
        max=1.0,
        rich_help_panel=RUNTIME,
    ),
]

TargetTensorParallel = Annotated[
    int,
    typer.Option(
        "--target-tensor-parallel",
        help="--target-engine vllm: run the target over this many GPUs (vLLM's "
        "tensor_parallel_size, its own worker processes; one process of spec, "
        "not torchrun). 1: in this process.",
        min=1,
        rich_help_panel=RUNTIME,
    ),
]


def in_panel(panel: str, option):
    """One of the shared options above, shown in another --help panel than its own."""
    kind, info = get_args(option)
    info = copy.copy(info)
    info.rich_help_panel = panel
    return Annotated[kind, info]
