"""What a draft algorithm declares: the one seam between the algorithms and the trainer, `spec eval`,
`spec export`, the target backends and the CLI (docs/architecture.md, "Draft algorithms").

An algorithm is a package (spec_cli/draft/eagle3/ is one) whose `__init__` builds one `Algorithm`
value; `ALGORITHMS` in spec_cli/draft/algorithms.py maps each name to it, and that line is the only
edit outside the package that a new algorithm needs. Everything the rest of spec_cli asks of an
algorithm is declared here, so no caller tells algorithms apart by name:

    name, title, summary     `--algorithm NAME`, how people write it ("EAGLE-3"), --help's phrase
    aux_layers, default_aux_layers(n)
                             how many target layers the draft reads and which by default, for a target
                             of n decoder layers (0-indexed layer OUTPUTS); precompute, serve-target,
                             train and eval ask these
    options                  a dataclass of its own `spec train` options (fields made with
                             spec_cli.train_options.option); the CLI, run.json and the objective
                             read them by name
    option_defaults          its defaults for options every algorithm takes, where they differ from
                             the option's declared one (the default algorithm's): (("ttt_steps", 7),)
                             for P-EAGLE; a value typed by the user, or recorded in a resumed
                             run's run.json, wins
    needs                    what it reads of the target besides its input embedding and the aux states:
                             "final_hidden" (the last hidden state after the final norm), "lm_head" (the
                             target's output head, copied into the draft), or a per-token field of its
                             own (`target_fields` of its implementation); every backend fills
                             TargetBatch.extras with what was asked
    formats                  the export formats `spec export` writes for it (ExportFormat: which engine
                             reads it, what that engine calls such drafts, the vLLM model runner that
                             serves it); which engines and releases serve an algorithm is read from these
    implementation           the module (torch) holding the code, loaded on first use:
        config(target_config, draft_vocab_size, aux_layer_ids, **overrides) -> DraftConfig
        build(config) -> the draft module
        objective(draft, options, activation_checkpointing=False) -> Objective (spec_cli/draft/contract.py)
        catch_up(draft, cache, ids, aux) -> state,  propose(draft, cache, state, depth, topk, ...)
        export(checkpoint, fmt, dtype) -> ExportFiles     (when it has formats)
        target_fields            {name: TargetField} for needs of its own (optional)
    export_rules             the module that reads its exports back the engine's way, independently of
                             the writer: check(folder, fmt, src, dtype) -> CheckReport (the export
                             self-check), recognise(config_json) -> format or None, and
                             read(folder, fmt, target_config) -> ReadExport (`spec eval --draft EXPORT`)
    vllm_draft_class         "module:Class" of the draft model vLLM builds for it (the engine check
                             watches its load_weights)
    draft_options            its options that are part of the draft's config (build_draft passes them to
                             config(); a resume with other values is refused): DFlash's ("block_size",)
    steps, steps_name        options -> how many metric steps its objective reports, and what the train
                             log calls them (None: the TTT steps; DFlash: "block offsets")
    eval_depth               config -> `spec eval`'s default --depth (None: 3; a block drafter: its block)
    sliding_window           True: it trains, decodes and exports a --draft-window
    context_parallel         True: its objective runs Objective.context_shard, so --context-parallel splits
                             its rows
    own_embeddings           False: it reads the target's input embeddings instead of copying them (MSD)
    curriculum               True: its objective takes the --curriculum schedule (MSD)
    not_served               why no serving engine runs it ("": it has export formats)

This module imports no torch: `spec --help` and the CLI read the declarations without loading models.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class ExportFormat:
    """One `spec export --format`: a folder layout a serving engine reads."""

    name: str  # what --format takes
    title: str  # how the README and the summary name it ("vLLM (speculators format)")
    engine: str | None  # the serving engine that reads it: "vllm", "sglang" (None: no engine)
    method: str = ""  # what that engine calls such drafts: vLLM's speculative_config "method",
    #                   SGLang's --speculative-algorithm
    engine_options: tuple[tuple[str, object], ...] = ()  # more keys of vLLM's speculative_config
    runner: str = (
        ""  # the one vLLM model runner that serves it ("": either): "v2" needs Triton (a GPU);
    )
    #                   "v1" is gone from vLLM 0.34 (spec_cli/engine/vllm_versions.py)


FINAL_HIDDEN = "final_hidden"  # a need: the target's last hidden state after its final norm
INPUT_EMBEDS = (
    "input_embeds"  # a need: what the target's first decoder layer reads (MSD's token inputs)
)
LM_HEAD = "lm_head"  # a need: the target's output head (the draft proposes through it)


@dataclass(frozen=True)
class Algorithm:
    name: str
    title: str
    aux_layers: int
    default_aux_layers: Callable[[int], list[int]]
    implementation: str  # module path, loaded on first use
    formats: tuple[ExportFormat, ...] = ()
    export_rules: str | None = None  # module path (see above); None: no export formats
    options: type | None = None  # a dataclass of train_options.option(...) fields
    option_defaults: tuple[tuple[str, object], ...] = ()  # (option name, its default here)
    needs: frozenset[str] = frozenset()
    summary: str = ""  # a phrase for --algorithm's help ("all draft tokens in one forward")
    vllm_draft_class: str = ""
    draft_options: tuple[str, ...] = ()
    steps: Callable[[object], int] | None = None
    steps_name: str = "TTT"
    eval_depth: Callable[[object], int] | None = None
    sliding_window: bool = False
    context_parallel: bool = False
    own_embeddings: bool = True
    curriculum: bool = False
    not_served: str = ""

    # -- the implementation, loaded when first asked (torch and the model code)
    @property
    def code(self) -> ModuleType:
        return importlib.import_module(self.implementation)

    @property
    def rules(self) -> ModuleType:
        if self.export_rules is None:
            raise AttributeError(f"{self.name} has no export formats")
        return importlib.import_module(self.export_rules)

    @property
    def config(self) -> Callable:
        return self.code.config

    def build(self, config):
        """The draft module for `config`, which must read as many aux layers as the algorithm does."""
        if len(config.aux_layer_ids) != self.aux_layers:
            from spec_cli.errors import ConfigError  # (no torch)

            raise ConfigError(
                f"{self.name} drafts read exactly {self.aux_layers} aux layers, this config has "
                f"{len(config.aux_layer_ids)}",
                f"pass {self.aux_layers} --aux-layers",
            )
        return self.code.build(config)

    @property
    def objective(self) -> Callable:
        return self.code.objective

    @property
    def catch_up(self) -> Callable:
        return self.code.catch_up

    @property
    def propose(self) -> Callable:
        return self.code.propose

    @property
    def export(self) -> Callable | None:
        return self.code.export if self.formats else None

    @property
    def target_fields(self) -> dict:
        """{name: TargetField} of the needs the algorithm computes itself (spec_cli/draft/contract.py)."""
        return dict(getattr(self.code, "target_fields", {}))

    # -- the declarations, as the callers use them
    @property
    def final_hidden(self) -> bool:
        return FINAL_HIDDEN in self.needs

    @property
    def format_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.formats)

    def format(self, name: str) -> ExportFormat:
        return next(f for f in self.formats if f.name == name)

    def engine_format(self, engine: str) -> ExportFormat | None:
        """The first of its formats that `engine` reads (vLLM's for the engine check and eval)."""
        return next((f for f in self.formats if f.engine == engine), None)

    def field_needs(self) -> tuple[str, ...]:
        """Its needs that are per-token fields of TargetBatch.extras (not the lm_head), in a fixed order."""
        return tuple(sorted(n for n in self.needs if n != LM_HEAD))
