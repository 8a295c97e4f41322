"""`spec train`: train a draft (spec_cli.stages.train).

Its flags are not declared in this file. Each is a field of one of the option dataclasses in
spec_cli/train_options.py (the groups of TrainConfig) or of a draft algorithm's own options
class (`Algorithm.options`, in the algorithm's package, e.g. spec_cli/draft/peagle/__init__.py);
`train_options.all_options()` lists them in --help order. The field's metadata holds the flag's names,
help, --help panel, checks and text parser (spec_cli/options.py).
A field made with `shared(...)` is an option other commands take too; it is declared once, in
spec_cli/commands/options.py, and `SHARED` below says which of those types train shows for it.
Then come --config and -q, as on every command.

`command()` turns these declarations into the command's parameters when spec_cli.cli.build_app()
builds the app, so the flags are those declared at that moment (an algorithm registered in
spec_cli/draft/algorithms.py brings its own), not when this module was imported.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING
from pathlib import Path
from typing import Annotated

import typer

from spec_cli import train_options
from spec_cli.commands.options import (
    AuxLayers,
    Config,
    Device,
    DraftAlgorithm,
    Dtype,
    MaxLength,
    NumProc,
    Quiet,
    TargetEngine,
    TargetMemory,
    TargetTensorParallel,
    in_panel,
)
from spec_cli.console import set_quiet
from spec_cli.help import DRAFT, INPUTS

TrainVocabMap = Annotated[
    Path | None,
    typer.Option(
        "--vocab-map",
        "-v",
        help="Vocab map written by `spec build-vocab-map`. Required, except with --resume "
        "(then the run's own, from its run.json).",
        rich_help_panel=INPUTS,
    ),
]
DraftAuxLayers = in_panel(DRAFT, AuxLayers)  # train: the layers are part of the draft's design
TrainAlgorithm = in_panel(DRAFT, DraftAlgorithm)

# the train options declared `shared(...)`: option name -> its type, as train shows it
SHARED = {
    "vocab_map": TrainVocabMap,
    "algorithm": TrainAlgorithm,
    "aux_layers": DraftAuxLayers,
    "max_length": MaxLength,
    "num_proc": NumProc,
    "device": Device,
    "dtype": Dtype,
    "target_engine": TargetEngine,
    "target_memory": TargetMemory,
    "target_tensor_parallel": TargetTensorParallel,
}


def train_cmd(config=None, quiet=False, **options):
    """Train a draft: EAGLE-3, or another --algorithm (EAGLE-1/2, P-EAGLE, DFlash, DSpark, MSD)
    (multi-process: `torchrun --nproc-per-node N`)."""
    from spec_cli.stages import train as stage
    from spec_cli.ui import print_train_summary

    set_quiet(quiet)
    declared = train_options.all_options()
    for name, value in options.items():  # text such as `4G` or `45m` -> the field's value
        flag = declared[name].flag
        if flag is not None and flag.parse is not None:
            options[name] = flag.parse(value, flag.names[0])
    given = train_options.typed_options()
    for name in train_options.algorithm_defaulted() - (given or set(declared)):
        del options[name]  # not typed: the --algorithm's own default (TrainConfig.from_options)
    result = stage.run(train_options.TrainConfig.from_options(**options))
    print_train_summary(result)
    if result.stream:
        from spec_cli.console import summary
        from spec_cli.stream import report_rows

        summary("stream", report_rows(result.stream))


def parameters() -> list[inspect.Parameter]:
    """`spec train`'s parameters: one per TrainConfig option, declared on its field
    (spec_cli/train_options.py) or, for an option other stages share, in SHARED; then --config, -q."""
    params = []
    for option in train_options.all_options().values():
        flag, default = option.flag, option.default
        if flag is None:
            annotation = SHARED[option.name]
        else:
            kind = (
                option.type
                if flag.parse is None
                else (str if flag.text is not None else str | None)
            )
            annotation = Annotated[
                kind,
                typer.Option(
                    *flag.names, help=flag.help, rich_help_panel=flag.panel, **flag.checks
                ),
            ]
            default = default if flag.parse is None else flag.text
        params.append(
            inspect.Parameter(
                option.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=annotation,
                default=inspect.Parameter.empty if default is MISSING else default,
            )
        )
    return params + [
        inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Config
        ),
        inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Quiet),
    ]


def command():
    """`train_cmd` as typer registers it: a new function each call, whose signature (the parameters
    typer reads) is made now from the options declared now."""

    def train(**options):
        train_cmd(**options)

    train.__doc__ = train_cmd.__doc__  # the --help text
    train.__signature__ = inspect.Signature(parameters())
    return train
