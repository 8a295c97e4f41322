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
from spec_cli.draft.config import DraftConfig
from spec_cli.errors import ArtifactError, ConfigError, listing
from spec_cli.export import engines, reader
from spec_cli.export.source import load_source
from spec_cli.target import loading


@dataclass
class LoadedDraft:
    model: object  # the algorithm's draft module, on the CPU, fp32; aux_layer_ids in the order the draft concatenates them
    kind: str  # "run" | "checkpoint" | "export"
    path: Path  # the folder read (the checkpoint folder for a run)
    format: str | None = None  # export format
    step: int | None = None  # training step, when known
    run_dir: Path | None = None
    recorded: dict = field(default_factory=dict)  # what the draft says it was made for (may be empty)
    needs_embeddings: bool = False  # the target's input embedding must be copied in
    needs_head: bool = False  # the target's lm_head must be copied in (an EAGLE-1/2 export)

    def describe(self) -> str:
        if self.kind == "export":
            return f"{self.path} ({self.format} export" + (f", step {self.step})" if self.step is not None
                                                             else ")")
        return f"{self.path} (step {self.step})"


def is_export(path: Path) -> bool:
    """An engine folder: config.json + model.safetensors, and no spec_cli checkpoint files."""
    path = Path(path)
    return ((path / "config.json").is_file() and (path / "model.safetensors").is_file()
            and not (path / "trainer_state.json").is_file())


def load_draft(path: Path, target_config) -> LoadedDraft:
    """A run folder, a checkpoint folder or an export folder -> the draft (weights on the CPU)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ArtifactError(f"--draft {path} does not exist",
                            "pass a `spec train` run folder, one of its checkpoints/step-* folders, or a "
                            "`spec export` folder")
    if is_export(path):
        if _eagle_export_format(path) is not None:
            return _from_eagle_export(path, target_config)
        return _from_export(path, target_config)
    # A checkpoint's embedding is in its run's frozen.safetensors; one taken out of its run folder
    # embeds with the target's own table, as an export does (the same table, copied at training).
    src = load_source(path, frozen_required=False)
    model = algorithms.get(src.config.algorithm).build(src.config)
    model.load_state_dict(src.state, strict=not src.missing_frozen)
    recorded = {"vocab_size": src.config.vocab_size, "target_hidden_size": src.config.target_hidden_size,
                "target_num_layers": src.config.target_num_layers,
                "target_fingerprint": src.config.target_fingerprint,
                "tokenizer_fingerprint": src.config.tokenizer_fingerprint,
                **_template_record(src.config.chat_template_sha256, src.config.chat_template_source,
                                   src.config.tokenizer_base_fingerprint)}
    kind = "checkpoint" if src.checkpoint.resolve() == path.resolve() else "run"
    return LoadedDraft(model=model.eval(), kind=kind, path=src.checkpoint, step=src.step,
                       run_dir=src.run_dir, recorded=recorded,
                       needs_embeddings="embed_tokens.weight" in src.missing_frozen)


# ----------------------------------------------------------------------------- exports

def _from_export(folder: Path, target_config) -> LoadedDraft:
    try:
        engine = reader.read(folder)
    except reader.Unreadable as exc:
        raise ArtifactError(f"cannot read the export in {folder}: {exc}",
                            "pass a complete folder written by `spec export`") from exc
    fmt, view, raw = engine.format, engine.view, engine.raw
    problems = list(view.problems)
    if view.norm_before_residual or view.norm_before_fc or not view.use_aux_hidden_state:
        problems.append("the engine would run a draft variant spec_cli does not model (norm_before_residual, "
                        "norm_before_fc or no aux states)")
    problems += engine.rejected  # keys the engine skips are fine: a folder from another tool may have some
    problems += [f"the engine's {name} is not in the file (it would serve a random weight there)"
                 for name in engine.missing]
    problems += engine.misshapen
    n_layers = loading.num_layers(target_config)
    arch = (getattr(target_config, "architectures", None) or [""])[0]
    block = raw.get("spec_cli") if isinstance(raw.get("spec_cli"), dict) else {}
    recorded = {"layers": block.get("target_num_layers"), "vocab size": view.vocab_size or None,
                "hidden size": view.target_hidden_size or None}
    text = target_config if getattr(target_config, "num_hidden_layers", None) else \
        getattr(target_config, "text_config", target_config)
    found = {"layers": n_layers, "vocab size": loading.vocab_size(target_config),
             "hidden size": getattr(text, "hidden_size", None)}
    differ = [f"{k} {recorded[k]} (the target has {found[k]})" for k in recorded
              if recorded[k] is not None and found[k] is not None and recorded[k] != found[k]]
    if differ:  # a different target, not a broken export: say what differs
        raise ArtifactError(f"the export {folder} was made for a target with " + ", ".join(differ),
                            "pass --target the model the draft was trained for")
    outputs, why = engines.captured_layer_outputs(view, n_layers, arch)
    if why:
        problems.append(why)
    if problems:
        raise ArtifactError(f"the {fmt} engine would not load {folder} as a working draft: "
                            + listing(problems),
                            "re-export the checkpoint with `spec export` (its self-check catches these)")

    state = reader.draft_state(engine.loaded)
    try:
        config = reader.draft_config(view, outputs, n_layers, target_architecture=arch,
                                     target_fingerprint=block.get("target_fingerprint") or "",
                                     tokenizer_fingerprint=block.get("tokenizer_fingerprint") or "")
        model = algorithms.get(config.algorithm).build(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        model.set_vocab_map(engine.targets)  # [Vd] the target id the engine emits per draft id
    except ConfigError as exc:
        raise ArtifactError(f"the draft in {folder} cannot be built: {exc.message}",
                            "re-export the checkpoint with `spec export`") from exc
    bad = sorted(set(missing) - {"embed_tokens.weight", "d2t", "t2d"}) + sorted(unexpected)
    if bad:
        raise ArtifactError(f"the export's weights do not fit its config ({bad[:3]})",
                            "re-export the checkpoint with `spec export`")
    recorded = {"vocab_size": view.vocab_size, "target_hidden_size": view.target_hidden_size,
                "target_num_layers": block.get("target_num_layers"),
                "target_fingerprint": block.get("target_fingerprint") or "",
                "tokenizer_fingerprint": block.get("tokenizer_fingerprint") or "",
                **_template_record(block.get("chat_template_sha256"), block.get("chat_template_source"),
                                   block.get("tokenizer_base_fingerprint"))}
    return LoadedDraft(model=model.eval(), kind="export", path=folder, format=fmt, step=block.get("step"),
                       recorded=recorded, needs_embeddings="embed_tokens.weight" in missing)


def _eagle_export_format(folder: Path) -> str | None:
    """vllm / sglang for an EAGLE-1/2 export (the class its engine builds), else None."""
    from spec_cli.export.eagle import CLASSES

    try:
        arch = (json.loads((folder / "config.json").read_text()).get("architectures") or [""])[0]
    except (OSError, ValueError):
        return None
    return next((fmt for fmt, names in CLASSES.items() if arch in names[:1]), None)


def _from_eagle_export(folder: Path, target_config) -> LoadedDraft:
    """An EAGLE-1/2 export, read as its engine reads it: the config's shapes (the ones the self-check
    proves), the file's weights, the target's embedding and lm_head."""
    from safetensors.torch import load_file

    from spec_cli.export.eagle import engine_shapes

    fmt = _eagle_export_format(folder)
    c = json.loads((folder / "config.json").read_text())
    block = c.get("spec_cli") if isinstance(c.get("spec_cli"), dict) else {}
    tensors = load_file(str(folder / "model.safetensors"))
    shapes = engine_shapes(fmt, c)
    bad = sorted(set(shapes) ^ set(tensors)) + sorted(k for k in shapes if k in tensors
                                                      and tuple(tensors[k].shape) != shapes[k])
    if bad:
        raise ArtifactError(f"the {fmt} engine would not load {folder} as a working draft (keys {bad[:3]})",
                            "re-export the checkpoint with `spec export` (its self-check catches these)")
    text = target_config if getattr(target_config, "num_hidden_layers", None) else \
        getattr(target_config, "text_config", target_config)
    parameters = c.get("rope_parameters") or {}
    scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    config = DraftConfig(
        vocab_size=c["vocab_size"], target_hidden_size=c["hidden_size"], aux_layer_ids=[],
        target_num_layers=block.get("target_num_layers") or loading.num_layers(target_config),
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"], draft_vocab_size=c["vocab_size"], num_hidden_layers=c["num_hidden_layers"],
        rms_norm_eps=c["rms_norm_eps"], rope_theta=parameters.get("rope_theta", c.get("rope_theta", 10000.0)),
        rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
        max_position_embeddings=c["max_position_embeddings"],
        target_architecture=(getattr(target_config, "architectures", None) or [""])[0],
        target_fingerprint=block.get("target_fingerprint") or "",
        tokenizer_fingerprint=block.get("tokenizer_fingerprint") or "", algorithm="eagle")
    if c["hidden_size"] != getattr(text, "hidden_size", None) or c["vocab_size"] != loading.vocab_size(target_config):
        raise ArtifactError(f"the export {folder} was made for a target with hidden size {c['hidden_size']} and "
                            f"vocab size {c['vocab_size']}", "pass --target the model the draft was trained for")
    model = algorithms.get("eagle").build(config)
    # the keys are the engine's (checked above); embed_tokens and lm_head come from the target
    model.load_state_dict({k: v.float() for k, v in tensors.items() if k != "fc.bias"}, strict=False)
    recorded = {"vocab_size": c["vocab_size"], "target_hidden_size": c["hidden_size"],
                "target_num_layers": block.get("target_num_layers"),
                "target_fingerprint": block.get("target_fingerprint") or "",
                "tokenizer_fingerprint": block.get("tokenizer_fingerprint") or "",
                **_template_record(block.get("chat_template_sha256"), block.get("chat_template_source"),
                                   block.get("tokenizer_base_fingerprint"))}
    return LoadedDraft(model=model.eval(), kind="export", path=folder, format=fmt, step=block.get("step"),
                       recorded=recorded, needs_embeddings=True, needs_head=True)


# ----------------------------------------------------------------------------- the target it is for

def _template_record(sha256: str | None, source: str | None, base_fingerprint: str | None) -> dict:
    """The chat template a draft's data was rendered with (and its tokenizer without it), when recorded."""
    return {"chat_template_sha256": sha256, "chat_template_source": source,
            "tokenizer_base_fingerprint": base_fingerprint} if base_fingerprint else {}


def check_target(draft: LoadedDraft, target_dir: Path, target_config, tokenizer,
                 check_fingerprint: bool = True, chat_template=None) -> None:
    """Raise ArtifactError unless the draft was made for this target: vocab, hidden size and depth, and
    (when the draft records them) the target's and tokenizer's fingerprints."""
    text = target_config if getattr(target_config, "num_hidden_layers", None) else \
        getattr(target_config, "text_config", target_config)
    found = {"vocab_size": loading.vocab_size(target_config),
             "target_hidden_size": getattr(text, "hidden_size", None),
             "target_num_layers": loading.num_layers(target_config)}
    hint = "pass --target the model the draft was trained for"
    for key, value in found.items():
        want = draft.recorded.get(key)
        if want is not None and want != value:
            raise ArtifactError(f"the draft was made for a target with {key.replace('_', ' ')} {want}; "
                                f"{target_dir} has {value}", hint)
    c = draft.model.config
    bad = [i for i in c.aux_layer_ids if not 0 <= i < found["target_num_layers"] - 1]
    if bad:
        raise ArtifactError(f"the draft reads target layers {bad}, which {target_dir} does not have", hint)
    if draft.needs_embeddings and c.hidden_size != found["target_hidden_size"]:
        raise ArtifactError(f"the draft has no embed_tokens and its hidden size {c.hidden_size} is not the "
                            f"target's {found['target_hidden_size']}, so the target's cannot be shared", hint)
    if not check_fingerprint:
        return
    recorded = draft.recorded.get("target_fingerprint")
    if recorded and recorded != loading.target_fingerprint(target_dir):
        raise ArtifactError(f"the draft was trained on a different target (fingerprint {recorded}) than "
                            f"{target_dir} (config or weights differ)",
                            f"{hint}, or add --no-fingerprint-check to evaluate it on this one anyway")
    recorded = draft.recorded.get("tokenizer_fingerprint")
    if recorded and recorded != loading.tokenizer_fingerprint(tokenizer):
        why = chat_templates.mismatch(draft.recorded, tokenizer, chat_template, "the draft's training data")
        if why is not None:
            raise ArtifactError(why[0], f"{why[1]}; or add --no-fingerprint-check")
        raise ArtifactError(f"the draft was trained with a different tokenizer or chat template than "
                            f"{target_dir}'s", f"{hint}, or add --no-fingerprint-check")
