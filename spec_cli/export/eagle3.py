"""The reading rules of EAGLE-3 and P-EAGLE exports (their Algorithm.export_rules): the self-check
(check.py: the folder read back with the engines' tables and compared with the checkpoint), which format
a folder is, and the draft an engine serves from it (`spec eval --draft EXPORT`), read the way the
engine reads it (reader.py), never with the writer's code (spec_cli/draft/eagle3/export.py,
spec_cli/draft/peagle/export.py)."""

from __future__ import annotations

from pathlib import Path

from spec_cli.draft import algorithms
from spec_cli.errors import ArtifactError, ConfigError, listing
from spec_cli.export import engines, reader
from spec_cli.export.check import check_export as check
from spec_cli.export.reader import ReadExport
from spec_cli.targets import loading

__all__ = ["check", "read", "recognise"]


def recognise(raw: dict) -> str | None:
    """The format a config.json of an EAGLE-3 family export was written for, or None (another kind of
    draft: an architecture no EAGLE-3 reader builds)."""
    arch = (raw.get("architectures") or [None])[0]
    if (
        arch is not None
        and arch not in engines.VLLM_ARCHITECTURES + engines.SGLANG_ARCHITECTURES
        and not (raw.get("speculators_model_type") or raw.get("model_type") == "speculators")
    ):
        return None
    try:
        return reader.export_format(raw)
    except ArtifactError:
        return None


def read(folder: Path, fmt: str, target_config) -> ReadExport:
    """The draft the `fmt` engine serves from `folder` (read with the engines' tables), for `spec eval`."""
    try:
        engine = reader.read(folder, fmt)
    except reader.Unreadable as exc:
        raise ArtifactError(
            f"cannot read the export in {folder}: {exc}",
            "pass a complete folder written by `spec export`",
        ) from exc
    fmt, view, raw = engine.format, engine.view, engine.raw
    problems = list(view.problems)
    if view.norm_before_residual or view.norm_before_fc or not view.use_aux_hidden_state:
        problems.append(
            "the engine would run a draft variant spec_cli does not model (norm_before_residual, "
            "norm_before_fc or no aux states)"
        )
    problems += (
        engine.rejected
    )  # keys the engine skips are fine: a folder from another tool may have some
    problems += [
        f"the engine's {name} is not in the file (it would serve a random weight there)"
        for name in engine.missing
    ]
    problems += engine.misshapen
    n_layers = loading.num_layers(target_config)
    arch = (getattr(target_config, "architectures", None) or [""])[0]
    block = raw.get("spec_cli") if isinstance(raw.get("spec_cli"), dict) else {}
    recorded = {
        "layers": block.get("target_num_layers"),
        "vocab size": view.vocab_size or None,
        "hidden size": view.target_hidden_size or None,
    }
    text = (
        target_config
        if getattr(target_config, "num_hidden_layers", None)
        else getattr(target_config, "text_config", target_config)
    )
    found = {
        "layers": n_layers,
        "vocab size": loading.vocab_size(target_config),
        "hidden size": getattr(text, "hidden_size", None),
    }
    differ = [
        f"{k} {recorded[k]} (the target has {found[k]})"
        for k in recorded
        if recorded[k] is not None and found[k] is not None and recorded[k] != found[k]
    ]
    if differ:  # a different target, not a broken export: say what differs
        raise ArtifactError(
            f"the export {folder} was made for a target with " + ", ".join(differ),
            "pass --target the model the draft was trained for",
        )
    outputs, why = engines.captured_layer_outputs(view, n_layers, arch)
    if why:
        problems.append(why)
    if problems:
        raise ArtifactError(
            f"the {fmt} engine would not load {folder} as a working draft: " + listing(problems),
            "re-export the checkpoint with `spec export` (its self-check catches these)",
        )

    state = reader.draft_state(engine.loaded)
    try:
        config = reader.draft_config(
            view,
            outputs,
            n_layers,
            target_architecture=arch,
            target_fingerprint=block.get("target_fingerprint") or "",
            tokenizer_fingerprint=block.get("tokenizer_fingerprint") or "",
        )
        model = algorithms.get(config.algorithm).build(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        model.set_vocab_map(engine.targets)  # [Vd] the target id the engine emits per draft id
    except ConfigError as exc:
        raise ArtifactError(
            f"the draft in {folder} cannot be built: {exc.message}",
            "re-export the checkpoint with `spec export`",
        ) from exc
    bad = sorted(set(missing) - {"embed_tokens.weight", "d2t", "t2d"}) + sorted(unexpected)
    if bad:
        raise ArtifactError(
            f"the export's weights do not fit its config ({bad[:3]})",
            "re-export the checkpoint with `spec export`",
        )
    recorded = {
        "vocab_size": view.vocab_size,
        "target_hidden_size": view.target_hidden_size,
        "target_num_layers": block.get("target_num_layers"),
        "target_fingerprint": block.get("target_fingerprint") or "",
        "tokenizer_fingerprint": block.get("tokenizer_fingerprint") or "",
        **reader.template_record(
            block.get("chat_template_sha256"),
            block.get("chat_template_source"),
            block.get("tokenizer_base_fingerprint"),
        ),
    }
    return ReadExport(
        model=model.eval(),
        format=fmt,
        step=block.get("step"),
        recorded=recorded,
        needs_embeddings="embed_tokens.weight" in missing,
    )
