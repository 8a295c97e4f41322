"""The draft to evaluate, from what the user has: a `spec train` run folder (its latest checkpoint), a
checkpoint folder, or an export folder of any format (vllm, sglang, speculators).

An export is read the way its engine reads it (`spec_cli.export.reader`, the export self-check's
reader, with the engines' tables): the engine's config view, where each file key goes, the engine's
draft-to-target id map, and which target layers the engine captures, in its concatenation order. So
what is evaluated is the draft the engine would serve from those very files. Exports carry no
embed_tokens (the engines share the target's); the target's input embedding is copied in, as it is for
a checkpoint moved out of its run folder (whose frozen.safetensors holds the embedding it trained with).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from spec_cli.data import chat_templates
from spec_cli.draft import algorithms
from spec_cli.errors import ArtifactError
from spec_cli.export.reader import template_record
from spec_cli.export.source import load_source
from spec_cli.targets import loading


@dataclass
class LoadedDraft:
    model: object  # the algorithm's draft module, on the CPU, fp32; aux_layer_ids in the order the draft concatenates them
    kind: str  # "run" | "checkpoint" | "export"
    path: Path  # the folder read (the checkpoint folder for a run)
    format: str | None = None  # export format
    step: int | None = None  # training step, when known
    run_dir: Path | None = None
    recorded: dict = field(
        default_factory=dict
    )  # what the draft says it was made for (may be empty)
    needs_embeddings: bool = False  # the target's input embedding must be copied in
    needs_head: bool = False  # the target's lm_head must be copied in (an EAGLE-1/2 export)

    def describe(self) -> str:
        if self.kind == "export":
            return f"{self.path} ({self.format} export" + (
                f", step {self.step})" if self.step is not None else ")"
            )
        return f"{self.path} (step {self.step})"


def is_export(path: Path) -> bool:
    """An export folder: config.json + model.safetensors, and no spec_cli checkpoint files."""
    path = Path(path)
    return (
        (path / "config.json").is_file()
        and (path / "model.safetensors").is_file()
        and not (path / "trainer_state.json").is_file()
    )


def load_draft(path: Path, target_config) -> LoadedDraft:
    """A run folder, a checkpoint folder or an export folder -> the draft (weights on the CPU)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ArtifactError(
            f"--draft {path} does not exist",
            "pass a `spec train` run folder, one of its checkpoints/step-* folders, or a "
            "`spec export` folder",
        )
    if is_export(path):
        return _from_export(path, target_config)
    # A checkpoint's embedding is in its run's frozen.safetensors; one taken out of its run folder
    # embeds with the target's own table, as an export does (the same table, copied at training).
    src = load_source(path, frozen_required=False)
    model = algorithms.get(src.config.algorithm).build(src.config)
    model.load_state_dict(src.state, strict=not src.missing_frozen)
    recorded = {
        "vocab_size": src.config.vocab_size,
        "target_hidden_size": src.config.target_hidden_size,
        "target_num_layers": src.config.target_num_layers,
        "target_fingerprint": src.config.target_fingerprint,
        "tokenizer_fingerprint": src.config.tokenizer_fingerprint,
        **template_record(
            src.config.chat_template_sha256,
            src.config.chat_template_source,
            src.config.tokenizer_base_fingerprint,
        ),
    }
    kind = "checkpoint" if src.checkpoint.resolve() == path.resolve() else "run"
    return LoadedDraft(
        model=model.eval(),
        kind=kind,
        path=src.checkpoint,
        step=src.step,
        run_dir=src.run_dir,
        recorded=recorded,
        needs_embeddings="embed_tokens.weight" in src.missing_frozen,
    )


# ----------------------------------------------------------------------------- exports


def _from_export(folder: Path, target_config) -> LoadedDraft:
    """The draft an export folder serves, read by the rules of the algorithm whose format it is."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot read the export in {folder}: {exc}",
            "pass a complete folder written by `spec export`",
        ) from exc
    raw = raw if isinstance(raw, dict) else {}
    block = raw.get("spec_cli") if isinstance(raw.get("spec_cli"), dict) else {}
    named = algorithms.ALGORITHMS.get(
        block.get("algorithm")
    )  # what spec export recorded; else ask each
    for algorithm in [named] if named is not None else algorithms.ALGORITHMS.values():
        fmt = algorithm.rules.recognise(raw) if algorithm.formats else None
        if fmt is not None:
            read = algorithm.rules.read(folder, fmt, target_config)
            return LoadedDraft(
                model=read.model,
                kind="export",
                path=folder,
                format=read.format,
                step=read.step,
                recorded=read.recorded,
                needs_embeddings=read.needs_embeddings,
                needs_head=read.needs_head,
            )
    arch = (raw.get("architectures") or [None])[0]
    raise ArtifactError(
        f"cannot tell which engine the config.json of {folder} is for (architecture {arch!r})",
        "pass a folder written by `spec export`, or a draft folder of a format one of "
        f"{', '.join(algorithms.ALGORITHMS)} reads",
    )


# ----------------------------------------------------------------------------- the target it is for


def check_target(
    draft: LoadedDraft,
    target_dir: Path,
    target_config,
    tokenizer,
    check_fingerprint: bool = True,
    chat_template=None,
) -> None:
    """Raise ArtifactError unless the draft was made for this target: vocab, hidden size and depth, and
    (when the draft records them) the target's and tokenizer's fingerprints."""
    text = (
        target_config
        if getattr(target_config, "num_hidden_layers", None)
        else getattr(target_config, "text_config", target_config)
    )
    found = {
        "vocab_size": loading.vocab_size(target_config),
        "target_hidden_size": getattr(text, "hidden_size", None),
        "target_num_layers": loading.num_layers(target_config),
    }
    hint = "pass --target the model the draft was trained for"
    for key, value in found.items():
        want = draft.recorded.get(key)
        if want is not None and want != value:
            raise ArtifactError(
                f"the draft was made for a target with {key.replace('_', ' ')} {want}; "
                f"{target_dir} has {value}",
                hint,
            )
    c = draft.model.config
    bad = [i for i in c.aux_layer_ids if not 0 <= i < found["target_num_layers"] - 1]
    if bad:
        raise ArtifactError(
            f"the draft reads target layers {bad}, which {target_dir} does not have", hint
        )
    if draft.needs_embeddings and c.hidden_size != found["target_hidden_size"]:
        raise ArtifactError(
            f"the draft has no embed_tokens and its hidden size {c.hidden_size} is not the "
            f"target's {found['target_hidden_size']}, so the target's cannot be shared",
            hint,
        )
    if not check_fingerprint:
        return
    recorded = draft.recorded.get("target_fingerprint")
    if recorded and recorded != loading.target_fingerprint(target_dir):
        raise ArtifactError(
            f"the draft was trained on a different target (fingerprint {recorded}) than "
            f"{target_dir} (config or weights differ)",
            f"{hint}, or add --no-fingerprint-check to evaluate it on this one anyway",
        )
    recorded = draft.recorded.get("tokenizer_fingerprint")
    if recorded and recorded != loading.tokenizer_fingerprint(tokenizer):
        why = chat_templates.mismatch(
            draft.recorded, tokenizer, chat_template, "the draft's training data"
        )
        if why is not None:
            raise ArtifactError(why[0], f"{why[1]}; or add --no-fingerprint-check")
        raise ArtifactError(
            f"the draft was trained with a different tokenizer or chat template than "
            f"{target_dir}'s",
            f"{hint}, or add --no-fingerprint-check",
        )
