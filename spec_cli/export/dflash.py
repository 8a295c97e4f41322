"""The reading rules of DFlash exports (DFLASH.export_rules): which format a folder is, the self-check
(the folder read back with vLLM 0.32's rules and compared with the checkpoint) and the draft vLLM serves
from it (`spec eval --draft EXPORT`). Written from vLLM's loader, never with the writer's code
(spec_cli/draft/dflash/export.py):

    config    vllm/transformers_utils/configs/speculators/algos.py update_dflash (the speculators format ->
              DFlashDraftModel: aux_hidden_state_layer_ids - 1 -> dflash_config.target_layer_ids,
              causal = not sliding_window_non_causal, absent: True -> non-causal), base.py (the speculative
              tokens from proposal_methods[0]); qwen3_dflash.py: the Qwen3 fields, rope theta 1e6 when a
              speculators config names none (set_default_rope_theta; a `qwen3` config.json gets
              transformers' 10000 first), per-layer causality (`is_causal`, then
              dflash_config.causal, then sliding layer_types), fc input = target_hidden_size x the aux count
    aux       eagle3_utils.py get_eagle3_aux_layers_from_config: eagle_aux_hidden_state_layer_ids as is, else
              target_layer_ids + 1, captured as the input of that layer (= output of the layer before)
    weights   DFlashQwen3ForCausalLM.load_weights: `model.` + name except lm_head, d2t -> draft_id_to_target_id
              (a parameter only when draft_vocab_size != the target's), t2d skipped, mask_hidden an error;
              embed_tokens and lm_head are the target's when the file has none
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from spec_cli.artifacts import vocab_map
from spec_cli.draft.config import DraftConfig
from spec_cli.errors import ArtifactError, ConfigError, listing
from spec_cli.export import engines
from spec_cli.export.check import (
    EXPECTED_FILES,
    CheckReport,
    _checkpoint_selected_ids,
    _materialise,
    compare_predictions,
    passed,
    tensor_problems,
)
from spec_cli.export.reader import ReadExport, template_record
from spec_cli.targets import loading

__all__ = ["check", "read", "recognise"]

ARCHITECTURE = "DFlashDraftModel"
QWEN3_ROPE_THETA = 1_000_000.0  # qwen3_dflash.py set_default_rope_theta
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class View:
    """The DFlash draft vLLM builds from a config.json."""

    fmt: str
    layer: engines.EngineView
    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    layer_outputs: list[int] = field(
        default_factory=list
    )  # spec_cli convention, vLLM's concatenation order
    mask_token_id: int | None = None
    causal: list[bool] = field(default_factory=list)
    speculative_tokens: int | None = (
        None  # the speculators format names it; vLLM's folder leaves it to the user
    )
    block_size: int | None = None
    problems: list[str] = field(default_factory=list)
    heads: dict = field(
        default_factory=dict
    )  # a family's own settings (DSpark: the Markov and confidence heads)


@dataclass(frozen=True)
class Family:
    """What tells the drafts that share these rules apart: DFlash's here, DSpark's (a DFlash backbone with
    two heads) in spec_cli/export/dspark.py."""

    title: str = "DFlash"
    algorithm: str = "dflash"
    architectures: tuple[str, ...] = (ARCHITECTURE,)  # vLLM's own format
    speculators_type: str = "dflash"
    first: int = 1  # the first block offset that proposes (DSpark's anchor proposes too: 0)
    reads_causal_key: bool = True  # vLLM turns speculators' sliding_window_non_causal into causal
    heads: Callable[[dict, str, View], None] | None = (
        None  # reads its own config fields into view.heads
    )
    params: Callable[[View], dict] | None = None  # its own parameters, with their shapes
    predict: Callable | None = (
        None  # (draft, ids, aux, positions) -> (per-offset (logits, ids), more pairs)
    )
    fp32: tuple[
        str, ...
    ] = ()  # weights vLLM builds in fp32 whatever the model's dtype (their name prefixes)


DFLASH = Family()


def recognise(raw: dict, family: Family = DFLASH) -> str | None:
    if raw.get("speculators_model_type") == family.speculators_type:
        return "speculators"
    if (raw.get("architectures") or [None])[0] in family.architectures:
        return "vllm"
    return None


def view_of(raw: dict, fmt: str, family: Family = DFLASH) -> View:
    problems: list[str] = []
    if fmt == "speculators":
        try:
            methods = raw["speculators_config"]["proposal_methods"]
            steps = int(methods[0]["speculative_tokens"])
            _ = raw["speculators_config"]["verifier"]["name_or_path"]
            layer = dict(raw["transformer_layer_config"])
            aux = [int(i) for i in raw["aux_hidden_state_layer_ids"]]
            mask = raw["mask_token_id"]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            return View(
                fmt,
                engines.EngineView("vllm"),
                problems=[f"vLLM cannot read the speculators config ({exc})"],
            )
        settings = {"mask_token_id": mask, "target_layer_ids": [i - 1 for i in aux]}
        if family.reads_causal_key:
            settings["causal"] = not raw.get("sliding_window_non_causal", True)
        vllm_ids, top = aux, raw
        layer["architectures"] = [ARCHITECTURE]
    else:
        layer, top, steps = raw, raw, None
        settings = {**(raw.get("eagle_config") or {}), **(raw.get("dflash_config") or {})}
        vllm_ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if vllm_ids is None:
            vllm_ids = [int(i) + 1 for i in settings.get("target_layer_ids") or []]
    view = engines.EngineView("vllm", architecture=ARCHITECTURE)
    engines._llama_fields(view, layer)
    if fmt == "speculators" and "rope_theta" not in layer and "rope_parameters" not in layer:
        # a speculators config class has no rope fields, so vLLM's set_default_rope_theta gives 1e6; a
        # `qwen3` config.json gets transformers' Qwen3Config default (10000) before vLLM looks
        view.rope_theta = QWEN3_ROPE_THETA
    problems += view.problems
    mask = settings.get("mask_token_id", top.get("mask_token_id"))
    if mask is None:
        problems.append(
            "no dflash_config.mask_token_id: vLLM refuses to start without a mask token"
        )
    if not settings.get("use_aux_hidden_state", True):
        problems.append("use_aux_hidden_state is false: vLLM would skip fc and the target's states")
    n = view.num_hidden_layers
    types = layer.get("layer_types") or []
    if any(t == "sliding_attention" for t in types) or settings.get("use_swa"):
        problems.append("sliding-window layers: the draft was trained with full attention")
    if layer.get("is_causal") is not None:
        causal = [bool(layer["is_causal"])] * n
    elif settings.get("causal") is not None:
        causal = [bool(settings["causal"])] * n
    else:
        causal = [bool(types) and types[i] == "sliding_attention" for i in range(n)]
    if any(causal):
        problems.append(
            "vLLM would run the block causally (is_causal / dflash_config.causal / "
            "speculators' sliding_window_non_causal: false); it was trained without a causal mask"
        )
    block = top.get("block_size")
    out = View(
        fmt,
        view,
        draft_vocab_size=int(top.get("draft_vocab_size") or view.vocab_size),
        target_hidden_size=int(top.get("target_hidden_size") or view.hidden_size),
        layer_outputs=[int(i) - 1 for i in vllm_ids],
        mask_token_id=None if mask is None else int(mask),
        causal=causal,
        speculative_tokens=steps,
        block_size=None if block is None else int(block),
        problems=problems,
    )
    if family.heads:
        family.heads(raw, fmt, out)
    return out


def expected_params(v: View, family: Family = DFLASH) -> dict[str, tuple[int, ...]]:
    """The checkpoint-named parameters vLLM's DFlashQwen3ForCausalLM holds, with their shapes."""
    L = v.layer
    H, h, kv, d, inter = (
        L.hidden_size,
        L.num_attention_heads,
        L.num_key_value_heads,
        L.head_dim,
        L.intermediate_size,
    )
    out = {
        "fc.weight": (H, v.target_hidden_size * len(v.layer_outputs)),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (v.draft_vocab_size, H),
    }
    for i in range(L.num_hidden_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (h * d, H),
                p + "self_attn.k_proj.weight": (kv * d, H),
                p + "self_attn.v_proj.weight": (kv * d, H),
                p + "self_attn.o_proj.weight": (H, h * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "mlp.gate_proj.weight": (inter, H),
                p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter),
            }
        )
    if v.draft_vocab_size != L.vocab_size:
        out["d2t"] = (v.draft_vocab_size,)
    if family.params:
        out.update(family.params(v))
    return out


@dataclass
class Loaded:
    view: View
    tensors: dict[str, torch.Tensor]  # as in the file
    loaded: dict[
        str, torch.Tensor
    ]  # what vLLM keeps (checkpoint names), embed_tokens included when shipped
    targets: torch.Tensor | None  # [Vd] the target id vLLM emits per draft id
    problems: list[str]
    meta: dict


def load(folder: Path, fmt: str | None = None, family: Family = DFLASH) -> Loaded:
    raw = json.loads((Path(folder) / "config.json").read_text())
    fmt = fmt or recognise(raw, family)
    if fmt is None:
        raise ArtifactError(
            f"{folder} is not a {family.title} export", "pass a folder written by `spec export`"
        )
    view = view_of(raw, fmt, family)
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata() or {}
    problems = list(view.problems)
    expected = expected_params(view, family) if view.layer.hidden_size else {}
    loaded = {}
    for key, tensor in tensors.items():
        if key == "t2d":
            continue  # skipped by vLLM
        if "mask_hidden" in key:
            problems.append(
                f"'{key}': vLLM's {family.title} loader asserts there is no mask_hidden weight"
            )
        elif key == "embed_tokens.weight":
            loaded[key] = (
                tensor  # the draft's own embedding (vLLM keeps it unless it equals the target's)
            )
        elif key not in expected:
            problems.append(
                f"'{key}': vLLM's {family.title} model has no such parameter (the load fails)"
            )
        elif tuple(tensor.shape) != expected[key]:
            problems.append(
                f"'{key}' is {tuple(tensor.shape)}, vLLM's parameter is {expected[key]}"
            )
        else:
            loaded[key] = tensor
    shared_head = (
        view.draft_vocab_size == view.layer.vocab_size
    )  # no lm_head: vLLM shares the target's
    for key in expected:
        if key not in tensors and not (key == "lm_head.weight" and shared_head):
            problems.append(f"vLLM's {key} is not in the file (it would keep a random value)")
    targets = None
    if view.layer.hidden_size and view.draft_vocab_size:
        offsets = loaded.get("d2t")
        base = torch.arange(view.draft_vocab_size)
        targets = (
            base
            if offsets is None and shared_head
            else (base + offsets.long() if offsets is not None else None)
        )
    return Loaded(view, tensors, loaded, targets, problems, meta)


def _draft_config(
    view: View, target_num_layers: int, block_size: int, family: Family = DFLASH, **provenance
) -> DraftConfig:
    L = view.layer
    return DraftConfig(
        vocab_size=L.vocab_size,
        target_hidden_size=view.target_hidden_size,
        aux_layer_ids=list(view.layer_outputs),
        target_num_layers=target_num_layers,
        hidden_size=L.hidden_size,
        intermediate_size=L.intermediate_size,
        num_attention_heads=L.num_attention_heads,
        num_key_value_heads=L.num_key_value_heads,
        head_dim=L.head_dim,
        draft_vocab_size=view.draft_vocab_size,
        num_hidden_layers=L.num_hidden_layers,
        rms_norm_eps=L.rms_norm_eps,
        rope_theta=L.rope_theta,
        rope_scaling=L.rope_scaling,
        max_position_embeddings=L.max_position_embeddings,
        hidden_act=L.hidden_act,
        mask_token_id=view.mask_token_id,
        algorithm=family.algorithm,
        extra={"block_size": block_size, **view.heads},
        **provenance,
    )


def _state(
    read: Loaded, embed: torch.Tensor, head: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    state = {k: v.float() for k, v in read.loaded.items() if k != "d2t"}
    state.setdefault("embed_tokens.weight", embed)
    if "lm_head.weight" not in state and head is not None:
        state["lm_head.weight"] = head
    state["d2t"] = vocab_map.d2t_from_ids(read.targets)
    state["t2d"] = vocab_map.t2d_from_ids(read.targets, read.view.layer.vocab_size)
    return state


# ----------------------------------------------------------------------------- the self-check


def check(folder: Path, fmt: str, src, dtype: torch.dtype, family: Family = DFLASH) -> CheckReport:
    return passed(fmt, *find_problems(Path(folder), fmt, src, dtype, family))


def find_problems(
    folder: Path, fmt: str, src, dtype: torch.dtype, family: Family = DFLASH
) -> tuple[list[str], CheckReport | None]:
    present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    problems = [f"{name} is missing" for name in sorted(EXPECTED_FILES - present)]
    problems += [f"{name} is not read by the engine" for name in sorted(present - EXPECTED_FILES)]
    if not {"config.json", "model.safetensors"} <= present:
        return problems, None
    try:
        read = load(folder, fmt, family)
    except (OSError, ValueError, ArtifactError) as exc:
        return problems + [f"the files cannot be read ({exc})"], None
    problems += read.problems
    if read.meta.get("format") != "pt":
        problems.append(
            "model.safetensors lacks the metadata format 'pt' transformers loaders require"
        )
    v, c = read.view, src.config
    if not v.layer.hidden_size:
        return problems, None
    fields = [
        ("vocab_size", v.layer.vocab_size, c.vocab_size),
        ("draft_vocab_size", v.draft_vocab_size, c.draft_vocab_size),
        ("hidden_size", v.layer.hidden_size, c.hidden_size),
        ("target_hidden_size", v.target_hidden_size, c.target_hidden_size),
        ("intermediate_size", v.layer.intermediate_size, c.intermediate_size),
        ("num_attention_heads", v.layer.num_attention_heads, c.num_attention_heads),
        ("num_key_value_heads", v.layer.num_key_value_heads, c.num_key_value_heads),
        ("head_dim", v.layer.head_dim, c.head_dim),
        ("num_hidden_layers", v.layer.num_hidden_layers, c.num_hidden_layers),
        ("rms_norm_eps", v.layer.rms_norm_eps, c.rms_norm_eps),
        ("rope_theta", v.layer.rope_theta, c.rope_theta),
        ("rope_scaling", v.layer.rope_scaling, engines.rope_scaling_of(c.rope_scaling)),
        ("hidden_act", v.layer.hidden_act, c.hidden_act),
        ("mask_token_id", v.mask_token_id, c.mask_token_id),
    ]
    problems += [
        f"{name} is {got} for vLLM, {want} in training" for name, got, want in fields if got != want
    ]
    block = int(c.extra.get("block_size", 0))
    most = block - family.first  # tokens one block proposes
    if v.speculative_tokens is not None and not 1 <= v.speculative_tokens <= most:
        problems.append(
            f"the config asks vLLM for {v.speculative_tokens} speculative tokens; the draft was "
            f"trained on blocks of {block} (at most {most})"
        )
    problems += [
        f"{name} is {v.heads.get(name)} for vLLM, {c.extra.get(name)} in training"
        for name in sorted(v.heads)
        if v.heads.get(name) != c.extra.get(name)
    ]
    if len(set(v.layer_outputs)) != len(v.layer_outputs):
        problems.append(
            f"the aux layers {v.layer_outputs} repeat a layer: vLLM captures each layer once, and fc "
            f"expects {len(v.layer_outputs)} states"
        )
    elif sorted(v.layer_outputs) != v.layer_outputs or v.layer_outputs != sorted(c.aux_layer_ids):
        problems.append(
            f"vLLM would feed the draft the outputs of layers {v.layer_outputs}; it was trained on "
            f"{sorted(c.aux_layer_ids)}"
        )
    problems += tensor_problems(read.tensors, dtype, family.fp32)
    selected = _checkpoint_selected_ids(src)
    if selected is None:
        problems.append("the checkpoint's d2t and t2d disagree")
    elif read.targets is None or not torch.equal(read.targets, selected):
        problems.append("draft ids map to the wrong target ids (a missing, zeroed or damaged d2t)")
    if problems:
        return problems, None

    # -- predictions: the draft vLLM builds vs the checkpoint, on the same random context and ids ----------
    embed = src.state["embed_tokens.weight"].to(dtype).float()
    try:
        exported = _materialise(
            _draft_config(v, c.target_num_layers, block, family), _state(read, embed)
        )
    except (ConfigError, RuntimeError, KeyError) as exc:
        return [f"vLLM's draft cannot be built from the export ({exc})"], None
    cast = {
        k: (
            t.to(dtype).float()
            if t.dtype in _FLOATS and not (family.fp32 and k.startswith(family.fp32))
            else t
        )
        for k, t in src.state.items()
    }
    cast["embed_tokens.weight"] = embed
    as_cast = _materialise(c, cast)
    as_trained = _materialise(
        c, {k: (t.float() if t.dtype in _FLOATS else t) for k, t in src.state.items()}
    )
    g = torch.Generator().manual_seed(0)
    B, T = 2, 12
    states = {
        layer: torch.randn(B, T, c.target_hidden_size, generator=g)
        for layer in set(c.aux_layer_ids)
    }
    ids = torch.randint(0, c.vocab_size, (B, T), generator=g)
    positions = torch.arange(T).expand(B, T)
    predict = family.predict or _predict
    (got, got_more), (want, want_more), (fp32, fp32_more) = (
        predict(d, ids, torch.cat([states[i] for i in layers], -1), positions)
        for d, layers in (
            (exported, v.layer_outputs),
            (as_cast, c.aux_layer_ids),
            (as_trained, c.aux_layer_ids),
        )
    )
    found, confident, agreement = compare_predictions(
        got, want, fp32, dtype, "block offset {}", first=family.first
    )
    problems += found
    if got_more:  # (DSpark: the confidence head, per block position)
        problems += compare_predictions(
            got_more,
            want_more,
            fp32_more,
            dtype,
            "confidence at block position {}",
            first=family.first,
        )[0]
    return problems, CheckReport(
        format=fmt,
        params_loaded=len(read.loaded),
        aux_layer_outputs=v.layer_outputs,
        positions=B * T * len(got),
        confident=confident,
        agreement_fp32=agreement,
    )


@torch.no_grad()
def _predict(draft, ids, aux, positions):
    """([(logits [B, T, Vd], target ids [B, T])] of every block offset, a block anchored at every slot; [])."""
    states = draft.block_forward(ids, aux, positions)
    return [
        (draft.logits(s).float(), draft.to_target_ids(draft.logits(s).float().argmax(-1)))
        for s in states
    ], []


# ----------------------------------------------------------------------------- spec eval --draft EXPORT


def read(folder: Path, fmt: str, target_config, family: Family = DFLASH) -> ReadExport:
    try:
        got = load(folder, fmt, family)
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot read the export in {folder}: {exc}",
            "pass a complete folder written by `spec export`",
        ) from exc
    v = got.view
    raw = json.loads((Path(folder) / "config.json").read_text())
    block = raw.get("spec_cli") if isinstance(raw.get("spec_cli"), dict) else {}
    problems = list(got.problems)
    text = (
        target_config
        if getattr(target_config, "num_hidden_layers", None)
        else getattr(target_config, "text_config", target_config)
    )
    n_layers = loading.num_layers(target_config)
    if (
        v.layer.vocab_size
        and v.layer.vocab_size != loading.vocab_size(target_config)
        or v.target_hidden_size != getattr(text, "hidden_size", v.target_hidden_size)
        or any(not 0 <= i < n_layers for i in v.layer_outputs)
    ):
        raise ArtifactError(
            f"the export {folder} was made for another target (vocab {v.layer.vocab_size}, hidden "
            f"{v.target_hidden_size}, layers {v.layer_outputs})",
            "pass --target the model the draft was trained for",
        )
    if got.targets is None:
        problems.append("no d2t for a draft vocab smaller than the target's")
    if "lm_head.weight" not in got.loaded:
        problems.append(
            "no lm_head (vLLM would share the target's; spec eval reads drafts with their own head)"
        )
    if problems:
        raise ArtifactError(
            f"vLLM would not load {folder} as a working draft: " + listing(problems),
            "re-export the checkpoint with `spec export` (its self-check catches these)",
        )
    size = v.block_size or (v.speculative_tokens + family.first if v.speculative_tokens else 16)
    config = _draft_config(
        v,
        n_layers,
        size,
        family,
        target_architecture=(getattr(target_config, "architectures", None) or [""])[0],
        target_fingerprint=block.get("target_fingerprint") or "",
        tokenizer_fingerprint=block.get("tokenizer_fingerprint") or "",
    )
    from spec_cli.draft import algorithms

    model = algorithms.get(family.algorithm).build(config)
    model.load_state_dict(_state(got, model.embed_tokens.weight.detach()), strict=True)
    recorded = {
        "vocab_size": v.layer.vocab_size,
        "target_hidden_size": v.target_hidden_size,
        "target_num_layers": block.get("target_num_layers"),
        "target_fingerprint": block.get("target_fingerprint") or "",
        "tokenizer_fingerprint": block.get("tokenizer_fingerprint") or "",
        **template_record(
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
        needs_embeddings="embed_tokens.weight" not in got.loaded,
    )
