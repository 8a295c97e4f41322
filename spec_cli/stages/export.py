"""`spec export`: write a draft checkpoint as a folder vLLM or SGLang serves as is, and prove it.

The folder is built beside -o, read back with its serving engine's loading rules and compared with the
checkpoint (the self-check, on by default), checked by vLLM itself when it is installed (the engine
check: vLLM loads the folder and its acceptance counts must match the checkpoint's), and only then
renamed to -o. A failure leaves -o as it was and nothing else behind.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from spec_cli import assets
from spec_cli.artifacts import outputs
from spec_cli.artifacts.checkpoint import choice_note
from spec_cli.artifacts.io import atomic_dir
from spec_cli.console import info, warn
from spec_cli.draft import algorithms
from spec_cli.draft.contract import DTYPE_NAMES
from spec_cli.engine.vllm import cannot_run as vllm_cannot_run
from spec_cli.errors import ConfigError, ExportError, SpecError
from spec_cli.eval import engine_check as engine
from spec_cli.export import DTYPES, formats
from spec_cli.export import support as engine_support
from spec_cli.export.check import CheckReport
from spec_cli.export.readme import format_title, model_impl, render, serve_command
from spec_cli.export.source import load_source
from spec_cli.targets import loading


@dataclass
class ExportConfig:
    source: (
        Path  # a run folder (RUN/best when kept, else its latest checkpoint) or a checkpoint folder
    )
    format: str  # vllm | sglang | speculators
    output: Path
    dtype: str = "bf16"  # float weights are cast to this
    check: bool = True  # read the export back with the engine's rules before renaming it to -o
    target: str | None = None  # target path/id to record; default: the one the run trained against
    engine_check: str | None = (
        None  # auto (vLLM when installed) | vllm | none; None: $SPEC_ENGINE_CHECK or auto
    )
    overwrite: bool = (
        False  # replace an earlier spec export in -o (refused otherwise, naming what is there)
    )
    allow_unsupported_target: bool = (
        False  # write it although the engine is known not to serve the target
    )


@dataclass
class ExportResult:
    output: Path
    format: str
    checkpoint: Path
    step: int
    dtype: str
    bytes: int
    engine_aux_ids: list[int]
    aux_layer_outputs: list[int]
    serve_command: str
    check: CheckReport | None
    seconds: float
    engine_check: engine.EngineCheckReport | None = None
    engine_check_note: str = ""  # why the engine check did not run
    support: engine_support.Support | None = (
        None  # does the serving engine serve this draft for this target
    )

    def summary_rows(self) -> list[tuple[str, object]]:
        rows = [
            ("format", format_title(self.format)),
            ("checkpoint", f"{self.checkpoint} (step {self.step})"),
            ("engine support", _support_row(self.support)),
            ("written", f"{self.output} ({self.bytes / 1e6:.1f} MB, {self.dtype})"),
            (
                "aux layer ids",
                f"{self.engine_aux_ids} as the engine counts them (layer outputs "
                f"{self.aux_layer_outputs})"
                if self.aux_layer_outputs
                else "none: the draft reads the target's final hidden state",
            ),
        ]
        if self.check is None:
            rows.append(("self-check", "skipped (--no-check)"))
        else:
            c = self.check
            what = (
                f"vocab map and aux layers {c.aux_layer_outputs}"
                if self.aux_layer_outputs
                else "exactly the engine's keys and shapes, config"
            )
            rows.append(
                (
                    "self-check",
                    f"passed: {c.params_loaded} tensors load, {what} as trained, "
                    f"predictions match on {c.positions} positions "
                    f"({c.agreement_fp32:.0%} vs fp32)",
                )
            )
        e = self.engine_check
        if e is None:
            rows.append(("engine check", self.engine_check_note or "skipped"))
        else:
            rows.append(
                (
                    "engine check",
                    f"passed: vLLM {e.version}"
                    + (f" (--model-impl {e.model_impl})" if e.model_impl else "")
                    + " loaded every draft weight"
                    + (f" (shares {', '.join(e.shared)} with the target)" if e.shared else "")
                    + f"; acceptance length {e.acceptance_length:.2f} vs "
                    f"{e.reference_acceptance_length:.2f} for the checkpoint on {e.prompts} "
                    f"greedy prompts (accepted per position {e.accepted} vs "
                    f"{e.reference_accepted}); same draft tokens at "
                    f"{e.drafts_equal:.0%} of {e.drafts_compared} steps",
                )
            )
        rows += [("serve", self.serve_command), ("time", f"{self.seconds:.1f} s")]
        return rows


def run(cfg: ExportConfig) -> ExportResult:
    start = time.perf_counter()
    fmt = cfg.format.lower()
    if fmt not in formats():
        raise ConfigError(
            f"--format {cfg.format!r} is not one of {', '.join(formats())}",
            "e.g. spec export runs/x --format vllm -o exports/x-vllm",
        )
    if cfg.dtype not in DTYPES:
        raise ConfigError(
            f"--dtype {cfg.dtype!r} is not one of {', '.join(DTYPES)}", "use bf16 (the default)"
        )
    dtype = DTYPES[cfg.dtype]
    outputs.check(
        {"-o": (cfg.output, outputs.EXPORT)},
        {"the source": cfg.source, "--target": cfg.target},
        replace_flag="--overwrite",
    )
    note = choice_note(
        cfg.source
    )  # a run that kept RUN/best: say that it is exported, not the latest
    if note:
        info(note)
    src = load_source(cfg.source, target=cfg.target)
    algorithm = algorithms.get(src.config.algorithm)
    if fmt not in algorithm.format_names and algorithm.not_served:  # (MSD: no engine runs it)
        raise ConfigError(
            f"{algorithm.title} drafts have no export: {algorithm.not_served}",
            "evaluate the run or checkpoint with `spec eval` (PyTorch)",
        )
    if fmt not in algorithm.format_names:
        raise ConfigError(
            f"{algorithm.name} drafts are not written as --format {fmt}",
            f"use one of {', '.join(algorithm.format_names)}"
            if algorithm.formats
            else f"spec export writes no engine format for {algorithm.name} yet; evaluate the "
            "checkpoint with `spec eval` (PyTorch)",
        )
    _check_target(src)
    served_as = algorithm.format(fmt)
    mode = engine.resolve_mode(
        cfg.engine_check, served_as, algorithm.title
    )  # before vLLM is asked anything
    if served_as.engine is None:  # a format no serving engine reads: nothing to check against
        support = engine_support.Support(
            format_title(fmt), True, "", f"no serving engine reads {fmt} folders"
        )
    elif (
        algorithm.aux_layers
    ):  # the support tables: which target classes capture aux states per engine
        support = check_support(
            served_as, algorithm, src.config.target_architecture, cfg.allow_unsupported_target
        )
    else:  # a draft that reads only the target's final hidden state: any target of its shape
        support = engine_support.Support(
            format_title(fmt), True, "", f"{algorithm.title} needs no aux-state capture"
        )
    files = algorithm.export(
        src, fmt, dtype
    )  # refuses what the engine cannot serve as trained, before any write
    files.config["spec_cli"]["engine_support"] = {
        "engine": support.engine,
        "served": support.served,
        "reason": support.reason,
        "source": support.source,
    }
    output = Path(cfg.output).resolve()
    _check_output(output, src.checkpoint, cfg.overwrite)
    target_dir, note = _engine_target(
        src, algorithm.format(fmt), mode, asked=(cfg.engine_check or "auto").lower()
    )
    impl = model_impl(support.served, support.engine) if served_as.engine == "vllm" else None
    if (
        target_dir is not None
        and support.served is not True
        and cfg.allow_unsupported_target
        and impl is None
    ):
        target_dir, note = None, f"skipped ({support.engine} does not serve this target natively)"
    if (
        target_dir is not None and algorithm.aux_layers and impl is None
    ):  # before writing: can vLLM capture aux states
        engine.refuse_unservable(loading.load_config(target_dir))
    info(f"exporting {src.checkpoint} (step {src.step}) for {format_title(fmt)} -> {output}")

    report = engine_report = None
    with _created_parents(output), atomic_dir(output) as tmp:
        save_file(files.tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(files.config, indent=2) + "\n")
        (tmp / "README.md").write_text(render(src, files, output, DTYPE_NAMES[dtype], support))
        if cfg.check:
            report = algorithm.rules.check(
                tmp, fmt, src, dtype
            )  # the engines' reading rules, not the writer's
        if target_dir is not None:
            info(
                f"engine check: loading the export in vLLM with {target_dir}"
                + (
                    f" (--model-impl {impl}: the native class does not capture aux states)"
                    if impl
                    else ""
                )
            )
            engine_report = engine.engine_check(
                tmp, fmt, src, dtype, target_dir, files.num_speculative_tokens, model_impl=impl
            )
    size = sum(p.stat().st_size for p in output.iterdir())
    return ExportResult(
        output=output,
        format=fmt,
        checkpoint=src.checkpoint,
        step=src.step,
        dtype=cfg.dtype,
        bytes=size,
        engine_aux_ids=files.engine_aux_ids,
        aux_layer_outputs=files.aux_layer_outputs,
        serve_command=serve_command(
            fmt, output, src.target, files.num_speculative_tokens, algorithm.name, impl
        ),
        check=report,
        seconds=time.perf_counter() - start,
        engine_check=engine_report,
        engine_check_note=note,
        support=support,
    )


def check_support(fmt, algorithm, architecture: str, allow: bool) -> engine_support.Support:
    """Refuse (or, with --allow-unsupported-target, warn about) an export for a serving engine known not
    to serve aux-reading drafts for this target; warn where it is not known. `fmt` is the ExportFormat
    asked for, of `algorithm`'s."""
    formats = algorithm.formats
    verdict = engine_support.support(fmt.engine, architecture)
    if verdict.served is True:
        return verdict
    others = engine_support.alternatives(fmt, formats, architecture)
    other = next((f for f in formats if others and f.name == others[0]), None)
    instead = (
        f"export --format {other.name} ({engine_support.support(other.engine, architecture).engine} serves "
        f"{architecture})"
        if other
        else ""
    )
    if verdict.served is False and not allow:
        article = "an" if algorithm.title[:1] in "AEIOU" else "a"
        raise ExportError(
            f"{verdict.engine} cannot serve {article} {algorithm.title} draft for this target: "
            f"{verdict.reason} (from {verdict.source})",
            (f"{instead}, or " if instead else "") + "pass --allow-unsupported-target to write "
            "it anyway (e.g. for vLLM's --model-impl transformers, or an engine release that "
            "added support)",
        )
    warn(
        f"{verdict.reason} (from {verdict.source}); the export is written, but check that your engine serves "
        "it" + (f", or {instead}" if instead else "")
    )
    return verdict


def _support_row(verdict: engine_support.Support | None) -> str:
    if verdict is None:
        return "-"
    if verdict.served and verdict.source.endswith("needs no aux-state capture"):
        return f"{verdict.engine} serves {verdict.source.split(' needs')[0]} drafts beside any target ({verdict.source})"
    if verdict.served:
        return f"{verdict.engine} serves aux-reading drafts for this target ({verdict.source})"
    return f"WARNING: {verdict.reason} ({verdict.source})"


def _engine_target(src, fmt, mode: str, asked: str) -> tuple[Path | None, str]:
    """The local target folder the engine check runs with (None: no check), and why not."""
    explicit = asked == "vllm"
    if mode == "none":
        if asked == "none":
            return None, "skipped (--engine-check none)"
        if fmt.engine != "vllm":
            return None, f"skipped (vLLM does not read {fmt.name} exports)"
        if vllm_cannot_run(fmt):
            return None, f"skipped ({vllm_cannot_run(fmt)})"
        return None, "skipped (vLLM is not installed; pip install -e '.[vllm]' adds this check)"
    try:
        return loading.resolve_target(assets.resolve_target_arg(src.target or "")), ""
    except SpecError as exc:
        if explicit:
            raise ConfigError(
                f"the engine check needs the target model, and {src.target!r} is not one here "
                f"({exc.message})",
                "pass --target the local target folder",
            ) from exc
        return (
            None,
            f"skipped (the target {src.target!r} is not a local model; pass --target to check)",
        )


def _check_target(src) -> None:
    """A target that is a local model folder must have the shape the draft was trained for (the README
    and the speculators verifier name it; a different target serves with low acceptance, silently)."""
    path = Path(src.target).expanduser() if src.target else None
    if path is None or not (path / "config.json").is_file():
        return
    config = loading.load_config(path)
    text = (
        config
        if getattr(config, "num_hidden_layers", None)
        else getattr(config, "text_config", config)
    )
    c = src.config
    found = (
        loading.num_layers(config),
        getattr(text, "hidden_size", None),
        getattr(text, "vocab_size", None),
    )
    wanted = (c.target_num_layers, c.target_hidden_size, c.vocab_size)
    if found != wanted:
        raise ConfigError(
            f"target {path} has (layers, hidden size, vocab) {found}; the draft was trained "
            f"for {wanted}",
            "pass --target the model the draft was trained for",
        )


def _check_output(output: Path, checkpoint: Path, overwrite: bool) -> None:
    """-o may be new, empty, or (with --overwrite) an earlier export; never a folder holding anything else."""
    if checkpoint.resolve().is_relative_to(output):
        raise ConfigError(
            f"-o {output} contains the checkpoint being exported", "choose a new output folder"
        )
    if not output.exists():
        return
    if not output.is_dir():
        raise ConfigError(f"-o {output} is a file", "choose a folder path for the export")
    if not any(output.iterdir()):
        return
    try:
        previous = json.loads((output / "config.json").read_text()).get("spec_cli", {})
    except (OSError, ValueError, AttributeError):
        previous = {}
    if not isinstance(previous, dict) or previous.get("kind") != "draft_export":
        raise ConfigError(
            f"-o {output} already exists and is not a spec export; it would be replaced",
            "choose a new output folder, or remove it first",
        )
    if not overwrite:
        raise ConfigError(
            f"-o {output} already holds a {previous.get('format')} export of step "
            f"{previous.get('step')} ({previous.get('checkpoint')})",
            "add --overwrite to replace it, or choose a new output folder",
        )


class _created_parents:
    """Remove the (empty) parent folders of -o this export created, if it fails."""

    def __init__(self, output: Path):
        self.created = []
        parent = output.parent
        while not parent.exists():
            self.created.append(parent)
            parent = parent.parent

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            for folder in self.created:  # deepest first
                try:
                    folder.rmdir()
                except OSError:
                    break
        return False
