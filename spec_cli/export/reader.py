"""An export folder read the way its serving engine reads it, with the tables of engines.py: the one reader of
the export's self-check (check.py) and of `spec eval --draft EXPORT` (eval/drafts.py).

    read          config.json -> the engine's view of the draft; every file key routed as the engine's
                  loader routes it (loaded, skipped, rejected); the parameters it needs and lacks; the
                  shapes it would refuse; the draft id -> target id map it serves with
    draft_config  that view as spec_cli's DraftConfig (with the aux layers the engine captures,
                  engines.captured_layer_outputs)
    draft_state   the loaded parameters under Eagle3Draft's names

It says what it found; each caller decides what is a problem (the self-check refuses a key the engine
skips, eval does not: a folder from another tool may carry one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from spec_cli.draft.config import DraftConfig
from spec_cli.errors import ArtifactError
from spec_cli.export import engines

VOCAB_PARAMS = ("draft_id_to_target_id", "hot_token_id")  # vLLM's, SGLang's draft id -> target id


class Unreadable(Exception):
    """config.json or model.safetensors cannot be read; the message says why."""


@dataclass
class EngineRead:
    format: str
    raw: dict  # config.json
    meta: dict  # model.safetensors metadata
    tensors: dict[str, torch.Tensor]  # file key -> tensor, as written
    view: engines.EngineView  # the draft the engine builds from config.json (its problems included)
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)  # engine parameter -> tensor
    unloaded: dict[str, engines.Route] = field(
        default_factory=dict
    )  # file key -> skipped / rejected
    missing: list[str] = field(
        default_factory=list
    )  # parameters the engine needs and the file lacks
    misshapen: list[str] = field(
        default_factory=list
    )  # loaded with another shape than the engine's

    @property
    def rejected(self) -> list[str]:
        """'key': why, for each file key the engine's loader fails on."""
        return [f"'{key}': {r.why}" for key, r in self.unloaded.items() if r.kind == "rejected"]

    @property
    def targets(self) -> torch.Tensor | None:
        """The target id the engine emits for each draft id [Vd], when it loaded a map of that size; a
        draft over the whole target vocab without one emits its own ids (vLLM builds no map then)."""
        name = next((n for n in VOCAB_PARAMS if n in self.loaded), None)
        if name is None and engines.full_vocab(self.view) and self.view.vocab_size:
            return torch.arange(self.view.vocab_size)
        if name is None or tuple(self.loaded[name].shape) != (self.view.draft_vocab_size,):
            return None
        return engines.draft_to_target(name, self.loaded[name])


def read(folder: Path, fmt: str | None = None) -> EngineRead:
    """The folder as the `fmt` engine reads it (None: the format its config.json is for). Raises
    Unreadable when a file cannot be read, ArtifactError when the format cannot be told."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, ValueError, SafetensorError) as exc:
        raise Unreadable(str(exc)) from exc
    fmt = fmt or export_format(raw)
    read_config, params_of, optional_of, route = engines.ENGINES[fmt]
    out = EngineRead(format=fmt, raw=raw, meta=meta, tensors=tensors, view=read_config(raw))
    for key, tensor in tensors.items():
        r = route(key, out.view)
        if r.kind != "param":
            out.unloaded[key] = r
        else:  # SGLang's load_weights builds hot_token_id from the file's d2t
            out.loaded[r.name] = (
                engines.hot_token_id(tensor.long()) if r.name == "hot_token_id" else tensor
            )
    expected, optional = params_of(out.view), optional_of(out.view)
    out.missing = sorted(set(expected) - set(out.loaded))
    for name, tensor in out.loaded.items():
        shape = expected.get(name) or optional.get(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            out.misshapen.append(
                f"{name} has shape {list(tensor.shape)}, the engine's is {list(shape)}"
            )
    return out


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
    raise ArtifactError(
        f"cannot tell which engine the config.json of this folder is for (architecture {arch!r})",
        "pass a folder written by `spec export`, or a vLLM/SGLang/speculators EAGLE-3 draft",
    )


def draft_config(
    view: engines.EngineView, aux_layer_ids: list[int], target_num_layers: int, **recorded
) -> DraftConfig:
    """The draft the engine builds, as spec_cli's config; `aux_layer_ids` are the layer outputs it
    captures (in its order), `recorded` what the folder says about its target (fingerprints...)."""
    return DraftConfig(
        vocab_size=view.vocab_size,
        target_hidden_size=view.target_hidden_size,
        aux_layer_ids=aux_layer_ids,
        target_num_layers=target_num_layers,
        hidden_size=view.hidden_size,
        intermediate_size=view.intermediate_size,
        num_attention_heads=view.num_attention_heads,
        num_key_value_heads=view.num_key_value_heads,
        head_dim=view.head_dim,
        draft_vocab_size=view.draft_vocab_size,
        num_hidden_layers=view.num_hidden_layers,
        rms_norm_eps=view.rms_norm_eps,
        rope_theta=view.rope_theta,
        rope_scaling=view.rope_scaling,
        max_position_embeddings=view.max_position_embeddings,
        hidden_act=view.hidden_act,
        fc_norm=view.fc_norm,
        norm_output=view.norm_output,
        sliding_window=view.sliding_window,
        **(
            {"algorithm": "peagle", "mask_token_id": view.mask_token_id}
            if view.parallel_drafting
            else {}
        ),
        **recorded,
    )


def draft_state(loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's loaded parameters under Eagle3Draft's names, fp32; the vocab map is left out (the
    caller sets it from `EngineRead.targets`) and so are parameters the engine loads but never uses."""
    state = {}
    for name, tensor in loaded.items():
        key = engines.to_draft_key(name)
        if key is not None and key not in ("d2t", "t2d"):
            state[key] = tensor.float()
    return state


@dataclass
class ReadExport:
    """An export folder read as its engine reads it: the draft that engine would serve (`spec eval`)."""

    model: object  # the algorithm's draft module, CPU, fp32; aux_layer_ids in the engine's concatenation order
    format: str
    step: int | None  # the training step the folder records
    recorded: (
        dict  # what the folder says the draft was made for (target shapes, fingerprints, template)
    )
    needs_embeddings: bool  # the target's input embedding must be copied in (engines share it)
    needs_head: bool = (
        False  # the target's lm_head must be copied in (the draft proposes through it)
    )


def template_record(sha256: str | None, source: str | None, base_fingerprint: str | None) -> dict:
    """The chat template a draft's data was rendered with (and its tokenizer without it), when recorded."""
    return (
        {
            "chat_template_sha256": sha256,
            "chat_template_source": source,
            "tokenizer_base_fingerprint": base_fingerprint,
        }
        if base_fingerprint
        else {}
    )
