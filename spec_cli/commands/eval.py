"""`spec eval`: real speculative decoding, its acceptance and speed-up (spec_cli.stages.eval)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spec_cli.commands.options import ChatTemplate, Config, Device, Dtype, Quiet, Target, Threads
from spec_cli.console import set_quiet
from spec_cli.help import DECODING, INPUTS, RUNTIME


def eval_cmd(
    target: Target,
    draft: Annotated[
        Path,
        typer.Option(
            "--draft",
            help="A `spec train` run folder (RUN/best when training kept one, else its latest "
            "checkpoint), a checkpoints/step-* folder, or "
            "a `spec export` folder of any format (read as its serving engine reads it).",
            rich_help_panel=INPUTS,
        ),
    ],
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            "-p",
            help="`mt-bench` (built-in, 2 turns each) or a chat data file (the user turns of "
            "each record).",
            rich_help_panel=INPUTS,
        ),
    ] = "mt-bench",
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Folder for eval.json, outputs.jsonl and acceptance.png. Default: RUN/eval/"
            "step-N for a run or checkpoint, EXPORT-eval beside an export.",
            rich_help_panel=INPUTS,
        ),
    ] = None,
    depth: Annotated[
        int | None,
        typer.Option(
            "--depth",
            help="Draft tokens per target forward (a tree's depth). Default: 3; a DFlash draft's block "
            "size - 1 (what one forward proposes).",
            min=1,
            rich_help_panel=DECODING,
        ),
    ] = None,
    compare_depths: Annotated[
        str | None,
        typer.Option(
            "--compare-depths",
            help="Also decode every turn with chains of these depths (comma-separated, e.g. "
            "1,2), after the target alone in the same run, and report each depth's "
            "acceptance length and speed-up over that same baseline: which "
            "num_speculative_tokens is fastest on this hardware. `auto`: the shorter chains "
            "whose verification forward this machine runs measurably cheaper (timed "
            "first). PyTorch, chains only.",
            rich_help_panel=DECODING,
        ),
    ] = None,
    topk: Annotated[
        int,
        typer.Option(
            "--topk",
            help="1: a chain; k > 1: an EAGLE-2 tree expanding the k best nodes per depth.",
            min=1,
            rich_help_panel=DECODING,
        ),
    ] = 1,
    num_tokens: Annotated[
        int | None,
        typer.Option(
            "--num-tokens",
            help="Tree only: drafted nodes verified per target forward (the most probable by "
            "cumulative draft log-prob). Default: 16.",
            min=1,
            rich_help_panel=DECODING,
        ),
    ] = None,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature",
            help="0: greedy (output identical to the target's); > 0: speculative sampling, "
            "which keeps the target's distribution.",
            min=0.0,
            rich_help_panel=DECODING,
        ),
    ] = 0.0,
    draft_sampling: Annotated[
        str,
        typer.Option(
            "--draft-sampling",
            help="With --temperature > 0, how a chain's draft proposes. greedy: its argmax, "
            "accepted with probability p_target(token), as vLLM serves by default "
            "(draft_sample_method greedy); sampled: drawn from its distribution q at the "
            "temperature, accepted with min(1, p/q) (vLLM's draft_sample_method "
            "probabilistic). Both keep the target's distribution; their acceptance differs.",
            rich_help_panel=DECODING,
        ),
    ] = "greedy",
    adaptive_verification: Annotated[
        float,
        typer.Option(
            "--adaptive-verification",
            help="A draft with a confidence head (DSpark): verify the chain's positions "
            "while the running product of its per-position confidences is at least "
            "this (as vLLM's enable_adaptive_verification sizes verification); 0: all. "
            "Greedy output is unchanged.",
            min=0.0,
            max=1.0,
            rich_help_panel=DECODING,
        ),
    ] = 0.0,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens",
            help="Tokens generated per turn at most.",
            min=1,
            rich_help_panel=DECODING,
        ),
    ] = 256,
    num_prompts: Annotated[
        int | None,
        typer.Option(
            "--num-prompts",
            help="Use this many prompts, spread over the categories. Default: all.",
            min=1,
            rich_help_panel=INPUTS,
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            "--seed", help="Seed for sampling (temperature > 0).", rich_help_panel=DECODING
        ),
    ] = 0,
    fingerprint_check: Annotated[
        bool,
        typer.Option(
            "--fingerprint-check/--no-fingerprint-check",
            help="Refuse a draft whose recorded target/tokenizer fingerprint is not this target's.",
            rich_help_panel=INPUTS,
        ),
    ] = True,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="torch: spec_cli's decoder (chain or tree); vllm: the same prompts inside vLLM "
            "(target alone and target + draft, vLLM's own acceptance counters; chain only; "
            "needs the vllm extra).",
            rich_help_panel=RUNTIME,
        ),
    ] = "torch",
    threads: Threads = None,
    timing_repeats: Annotated[
        int,
        typer.Option(
            "--timing-repeats",
            help="Decode each turn this many times with each decoder, alternating, and "
            "keep each turn's median time (same seeds: the same output).",
            min=1,
            rich_help_panel=RUNTIME,
        ),
    ] = 1,
    chat_template: ChatTemplate = None,
    device: Device = None,
    dtype: Dtype = None,
    config: Config = None,
    quiet: Quiet = False,
):
    """Run real speculative decoding (target verifies, draft proposes) and report the acceptance length,
    the acceptance rate by draft position and the speed-up over the target alone."""
    from spec_cli.eval.report import print_table
    from spec_cli.stages import eval as stage

    set_quiet(quiet)
    result = stage.run(
        stage.EvalConfig(
            target=target,
            draft=draft,
            prompts=prompts,
            output=output,
            depth=depth,
            topk=topk,
            num_tokens=num_tokens,
            temperature=temperature,
            draft_sampling=draft_sampling,
            max_new_tokens=max_new_tokens,
            adaptive_verification=adaptive_verification,
            num_prompts=num_prompts,
            seed=seed,
            device=device,
            dtype=dtype,
            check_fingerprint=fingerprint_check,
            engine=engine,
            threads=threads,
            timing_repeats=timing_repeats,
            chat_template=chat_template,
            compare_depths=parse_depths(compare_depths),
        )
    )
    print_table(result)


def parse_depths(text: str | None) -> tuple[int, ...] | str:
    """ "1,2" -> (1, 2); "auto" stays; a bad list is one clear error."""
    from spec_cli.errors import ConfigError

    if not text:
        return ()
    if text.strip() == "auto":
        return "auto"
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(
            f"--compare-depths {text!r} is not a list of whole numbers", "e.g. --compare-depths 1,2"
        ) from None
