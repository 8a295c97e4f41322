"""The draft to evaluate, from what the user has: a `spec train` run folder (its latest checkpoint), a
checkpoint folder, or an export folder of any format (vllm, sglang, speculators).

An export is read the way its engine reads it (`spec_cli.export.engines`, the tables the export
self-check uses): the engine's config view, where each file key goes, the engine's draft-to-target id
map, and which target layers the engine captures, in its concatenation order. So what is evaluated is
the draft the engine would serve from those very files. Exports carry no embed_tokens (the engines
share the target's); the target's input embedding is copied in, as it is for a checkpoint moved out
of its run folder (whose frozen.safetensors holds the embedding it trained with).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from spec_cli.data import chat_templates
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.model import Eagle3Draft
from spec_cli.errors import ArtifactError, ConfigError, listing
from spec_cli.export import engines
from spec_cli.export.source import load_source
from spec_cli.target import loading


@dataclass
class LoadedDraft:
    model: Eagle3Draft  # on the CPU, fp32; aux_layer_ids in the order the draft concatenates them
    kind: str  # "run" | "checkpoint" | "export"
    path: Path  # the folder read (the checkpoint folder for a run)
    format: str | None = None  # export format
    step: int | None = None  # training step, when known
    run_dir: Path | None = None
    recorded: dict = field(default_factory=dict)  # what the draft says it was made for (may be empty)
    needs_embeddings: bool = False  # the target's input embedding must be copied in

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
        return _from_export(path, target_config)
    # A checkpoint's embedding is in its run's frozen.safetensors; one taken out of its run folder
    # embeds with the target's own table, as an export does (the same table, copied at training).
    src = load_source(path, frozen_required=False)
    model = Eagle3Draft(src.config)
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

def export_format(raw: dict) -> str:
    """The format a config.json was written for: spec_cli's own record, else what the config looks like
    (a folder exported by another tool)."""
    block = raw.get("spec_cli") if isinstance(raw.get("spec_cli"), dict) else {}
    if block.get("format") in engines.ENGINES:
        return block["format"]
    if raw.get("speculators_model_type") or raw.get("model_type") == "speculators":
        return "speculators"
    arch = (raw.get("architectures") or [None])[0]
    eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        return "sglang"
    if arch in engines.VLLM_ARCHITECTURES:
        return "vllm"
    raise ArtifactError(f"cannot tell which engine the config.json of this folder is for (architecture "
                        f"{arch!r})", "pass a folder written by `spec export`, or a vLLM/SGLang/speculators "
                                      "EAGLE-3 draft")


def _from_export(folder: Path, target_config) -> LoadedDraft:
    try:
        raw = json.loads((folder / "config.json").read_text())
        tensors = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ArtifactError(f"cannot read the export in {folder}: {exc}",
                            "pass a complete folder written by `spec export`") from exc
    fmt = export_format(raw)
    read, params_of, optional_of, route = engines.ENGINES[fmt]
    view = read(raw)
    problems = list(view.problems)
    if view.norm_before_residual or view.norm_before_fc or not view.use_aux_hidden_state:
        problems.append("the engine would run a draft variant spec_cli does not model (norm_before_residual, "
                        "norm_before_fc or no aux states)")
    loaded: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        r = route(key, view)
        if r.kind == "rejected":
            problems.append(f"'{key}': {r.why}")
        elif r.kind == "param":
            loaded[r.name] = engines.hot_token_id(tensor.long()) if r.name == "hot_token_id" else tensor
    expected, optional = params_of(view), optional_of(view)
    problems += [f"the engine's {name} is not in the file (it would serve a random weight there)"
                 for name in sorted(set(expected) - set(loaded))]
    for name, tensor in loaded.items():
        shape = expected.get(name) or optional.get(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            problems.append(f"{name} has shape {list(tensor.shape)}, the engine's is {list(shape)}")
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

    vocab_name = "hot_token_id" if "hot_token_id" in loaded else "draft_id_to_target_id"
    targets = engines.draft_to_target(vocab_name, loaded[vocab_name])  # [Vd] target id per draft id
    state = {key: t for name, t in loaded.items()
             if (key := engines.to_draft_key(name)) is not None and key not in ("d2t", "t2d")}
    try:
        config = DraftConfig(
            vocab_size=view.vocab_size, target_hidden_size=view.target_hidden_size, aux_layer_ids=outputs,
            target_num_layers=n_layers, hidden_size=view.hidden_size,
            intermediate_size=view.intermediate_size,
            num_attention_heads=view.num_attention_heads, num_key_value_heads=view.num_key_value_heads,
            head_dim=view.head_dim, draft_vocab_size=view.draft_vocab_size,
            num_hidden_layers=view.num_hidden_layers, rms_norm_eps=view.rms_norm_eps,
            rope_theta=view.rope_theta, rope_scaling=view.rope_scaling,
            max_position_embeddings=view.max_position_embeddings, hidden_act=view.hidden_act,
            fc_norm=view.fc_norm, norm_output=view.norm_output, target_architecture=arch,
            target_fingerprint=block.get("target_fingerprint") or "",
            tokenizer_fingerprint=block.get("tokenizer_fingerprint") or "")
        model = Eagle3Draft(config)
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        model.set_vocab_map(targets)
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
