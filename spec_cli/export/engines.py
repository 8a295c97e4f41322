"""How each serving engine reads an export folder, as explicit tables written from the engines' loaders.

This is the self-check's half of export and deliberately shares nothing with the writers
(`spec_cli/draft/*/export.py`): it starts from the folder's config.json and model.safetensors and
asks, as the engine's code does, which parameters the model has (names, shapes), where each file key
goes (loaded, renamed, skipped, rejected), how the aux layer ids and the EAGLE-3.1 flags are
interpreted, and how draft ids become target ids. Sources, read for these tables:

vLLM   vllm/model_executor/models/llama_eagle3.py   Eagle3LlamaForCausalLM (__init__, load_weights,
                                                     compute_logits, combine_hidden_states),
                                                     LlamaModel (__init__, forward, load_weights)
       vllm/model_executor/models/llama.py           LlamaModel.forward (aux capture),
                                                     get_eagle3_aux_hidden_state_layers (default ids)
       vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py  get_eagle3_aux_layers_from_config
       vllm/v1/worker/gpu/spec_decode/eagle/utils.py load_eagle_model (embed/lm_head sharing)
       vllm/model_executor/models/registry.py        _SPECULATIVE_DECODING_MODELS
       vllm/transformers_utils/configs/speculators/{base,algos}.py  SpeculatorsConfig, update_eagle3
SGLang python/sglang/srt/models/llama_eagle3.py      LlamaForCausalLMEagle3 (__init__, load_weights),
                                                     LlamaModel.forward
       python/sglang/srt/models/llama.py, qwen3.py   set_eagle3_layers_to_capture, LlamaModel.forward
       python/sglang/srt/model_executor/model_runner.py  eagle_config["eagle_aux_hidden_state_layer_ids"]
       python/sglang/srt/speculative/eagle_worker.py set_embed (the target's embedding replaces the draft's)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec_cli.artifacts import vocab_map

# vllm/model_executor/models/registry.py: both names load llama_eagle3.Eagle3LlamaForCausalLM
# (vllm/transformers_utils/configs/eagle.py EAGLEConfig keeps a name that starts or ends with "Eagle3").
VLLM_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
# python/sglang/srt/models/llama_eagle3.py: EntryClass = [LlamaForCausalLMEagle3].
SGLANG_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


@dataclass
class EngineView:
    """The draft model an engine builds from config.json (before any weight is loaded)."""

    engine: str
    architecture: str | None = None
    vocab_size: int = 0
    draft_vocab_size: int = 0
    hidden_size: int = 0
    target_hidden_size: int = 0
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    num_hidden_layers: int = 0
    rms_norm_eps: float = 0.0
    rope_theta: float = 0.0
    rope_scaling: dict | None = None  # None: default rope; else the scaling dict incl. rope_type
    max_position_embeddings: int = 0
    hidden_act: str = ""
    fc_norm: bool = False  # one RMSNorm per aux chunk before fc
    norm_output: bool = False  # the post-norm state is fed to the next draft step
    sliding_window: int | None = None  # every draft layer attends the last W positions (None: all)
    norm_before_residual: bool = False  # hidden_norm applied before the residual is taken
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states
    use_aux_hidden_state: bool = True
    aux_ids: list[int] | None = None  # as written; None: the engine's default
    parallel_drafting: bool = (
        False  # a P-EAGLE draft: mask_hidden + mask_token_id, all depths in one forward
    )
    mask_token_id: int | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Route:
    """Where the engine's loader sends one file key."""

    kind: (
        str  # "param" | "skipped" (dropped, silently or with a log line) | "rejected" (load fails)
    )
    name: str | None = None  # the engine's parameter (q/k/v and gate/up as their unfused shards)
    why: str = ""


# ----------------------------------------------------------------------------- config.json


def _rope(d: dict, problems: list[str]) -> tuple[float, dict | None]:
    """transformers 5 reads `rope_parameters`, transformers 4 `rope_theta` + `rope_scaling` (vLLM's
    patch_rope_parameters converts the latter). Where both are written they must agree."""
    legacy_theta = float(d.get("rope_theta", 10000.0))
    legacy = rope_scaling_of(d.get("rope_scaling"))
    if d.get("rope_parameters") is None:
        return legacy_theta, legacy
    params = dict(d["rope_parameters"])
    theta = float(params.get("rope_theta", legacy_theta))
    scaling = rope_scaling_of(params)
    if ("rope_theta" in d and legacy_theta != theta) or ("rope_scaling" in d and legacy != scaling):
        problems.append(
            f"rope_parameters {d['rope_parameters']} and rope_theta/rope_scaling "
            f"({d.get('rope_theta')}, {d.get('rope_scaling')}) disagree: transformers 4 and 5 "
            "would build different rotary embeddings"
        )
    return theta, scaling


def rope_scaling_of(raw: dict | None) -> dict | None:
    """A rope dict -> its scaling part with `rope_type` (None for default rope); theta dropped."""
    if not raw:
        return None
    out = {k: v for k, v in raw.items() if k != "rope_theta"}
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    return None if out.get("rope_type", "default") == "default" else out


def _llama_fields(view: EngineView, d: dict) -> None:
    """LlamaConfig fields (with LlamaConfig / the engines' getattr defaults)."""
    try:
        view.hidden_size = int(d["hidden_size"])
        view.num_attention_heads = int(d["num_attention_heads"])
        view.intermediate_size = int(d["intermediate_size"])
        view.num_hidden_layers = int(d["num_hidden_layers"])
        view.vocab_size = int(d["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        view.problems.append(f"config.json lacks a Llama layer field the engine needs ({exc})")
        return
    view.num_key_value_heads = int(d.get("num_key_value_heads") or view.num_attention_heads)
    view.head_dim = int(d.get("head_dim") or view.hidden_size // view.num_attention_heads)
    view.rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
    view.max_position_embeddings = int(d.get("max_position_embeddings", 2048))
    view.hidden_act = d.get("hidden_act", "silu")
    view.rope_theta, view.rope_scaling = _rope(d, view.problems)
    view.sliding_window = _window(d, view.num_hidden_layers, view.problems)
    if d.get("attention_bias") or d.get("mlp_bias"):
        view.problems.append(
            "attention_bias/mlp_bias is set: the engine would add bias parameters the "
            "draft does not have and leave them uninitialised"
        )


def _window(d: dict, num_layers: int, problems: list[str]) -> int | None:
    """vLLM's LlamaAttention (llama.py): a draft layer i attends a sliding window of `sliding_window`
    positions when `layer_types[i]` is "sliding_attention" (i counted from the draft's first layer:
    Eagle3LlamaForCausalLM sets target_layer_count); without layer_types, the model-level window of the
    cache config, which is the target's, not this file's. spec_cli trains one window for every layer."""
    types = d.get("layer_types")
    if not types:
        return None
    if len(types) < num_layers:
        problems.append(
            f"layer_types lists {len(types)} layer(s) for {num_layers} draft layers (vLLM asserts "
            "every draft layer has an entry)"
        )
        return None
    sliding = [t == "sliding_attention" for t in types[:num_layers]]
    if not any(sliding):
        return None
    window = d.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        problems.append(f"layer_types asks for sliding attention but sliding_window is {window!r}")
        return None
    if not all(sliding):
        problems.append(
            f"layer_types {types} mixes sliding and full attention; spec_cli's drafts use one "
            "window for every layer"
        )
    return window


def read_vllm(d: dict, engine: str = "vllm") -> EngineView:
    """vLLM's hf_config -> Eagle3LlamaForCausalLM / LlamaModel (llama_eagle3.py __init__)."""
    view = EngineView(engine=engine)
    archs = d.get("architectures") or [None]
    view.architecture = archs[0]
    if view.architecture not in VLLM_ARCHITECTURES:
        view.problems.append(
            f"architecture {view.architecture!r} is not one vLLM loads as an EAGLE-3 draft "
            f"({', '.join(VLLM_ARCHITECTURES)})"
        )
    _llama_fields(view, d)
    # Eagle3LlamaForCausalLM.__init__: draft_vocab_size defaults to vocab_size when absent.
    view.draft_vocab_size = int(d.get("draft_vocab_size") or view.vocab_size)
    # LlamaModel.__init__: hasattr(config, "target_hidden_size") else hidden_size.
    if "target_hidden_size" in d and d["target_hidden_size"] is None:
        view.problems.append("target_hidden_size is null: vLLM sizes fc from it and fails")
    view.target_hidden_size = int(d.get("target_hidden_size") or view.hidden_size)
    eagle_config = d.get("eagle_config") or {}
    view.use_aux_hidden_state = bool(eagle_config.get("use_aux_hidden_state", True))
    view.norm_before_fc = bool(eagle_config.get("norm_before_fc", d.get("norm_before_fc", False)))
    view.fc_norm = bool(d.get("fc_norm", False))
    view.norm_output = bool(d.get("norm_output", False))
    view.norm_before_residual = bool(d.get("norm_before_residual", False))
    # get_eagle3_aux_layers_from_config: the top-level list, when non-empty.
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    view.aux_ids = [int(i) for i in ids] if isinstance(ids, (list, tuple)) and ids else None
    # parallel drafting (served with "parallel_drafting": true): llm_base_proposer.py
    # _init_parallel_drafting_params reads the mask slots' token from mask_token_id, else pard_token
    # (what update_peagle writes for a speculators folder), else ptd_token_id
    token = next(
        (d[k] for k in ("mask_token_id", "pard_token", "ptd_token_id") if d.get(k) is not None),
        None,
    )
    view.parallel_drafting = token is not None
    view.mask_token_id = int(token) if token is not None else None
    return view


def read_sglang(d: dict) -> EngineView:
    """SGLang's hf_config -> LlamaForCausalLMEagle3 (llama_eagle3.py) + model_runner's aux ids."""
    view = EngineView(engine="sglang")
    archs = d.get("architectures") or [None]
    view.architecture = archs[0]
    if view.architecture not in SGLANG_ARCHITECTURES:
        view.problems.append(
            f"architecture {view.architecture!r} is not SGLang's EAGLE-3 Llama draft "
            f"({', '.join(SGLANG_ARCHITECTURES)})"
        )
    _llama_fields(view, d)
    if d.get("draft_vocab_size") is None:
        view.problems.append(
            "draft_vocab_size is missing: SGLang then loads the target's full lm_head "
            "(load_lm_head_from_target) and ignores the draft's"
        )
    view.draft_vocab_size = int(d.get("draft_vocab_size") or view.vocab_size)
    if d.get("tie_word_embeddings"):
        view.problems.append(
            "tie_word_embeddings is true: SGLang then uses embed_tokens as the lm_head"
        )
    if view.num_hidden_layers != 1:
        view.problems.append(
            f"num_hidden_layers is {view.num_hidden_layers}: SGLang versions build and name "
            "the extra layers differently (additional_layers / layers.{i})"
        )
    view.target_hidden_size = int(d.get("target_hidden_size") or view.hidden_size)
    # LlamaModel: fc_norm (or the legacy use_aux_norm), norm_output; the residual is always the
    # un-normed hidden (LlamaDecoderLayer.forward) and there is no input_norm.
    view.fc_norm = bool(d.get("fc_norm") or d.get("use_aux_norm", False))
    view.norm_output = bool(d.get("norm_output", False))
    if d.get("norm_before_residual") or d.get("norm_before_fc"):
        view.problems.append(
            "norm_before_residual/norm_before_fc is set, which SGLang's EAGLE-3 Llama draft ignores"
        )
    eagle_config = d.get("eagle_config") or {}
    view.use_aux_hidden_state = bool(eagle_config.get("use_aux_hidden_state", True))
    # model_runner.py reads eagle_config["eagle_aux_hidden_state_layer_ids"] only.
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    view.aux_ids = [int(i) for i in ids] if isinstance(ids, (list, tuple)) and ids else None
    if view.aux_ids is None and d.get("eagle_aux_hidden_state_layer_ids"):
        view.problems.append(
            "the aux layer ids are at the top level, where SGLang does not look "
            "(it reads eagle_config.eagle_aux_hidden_state_layer_ids)"
        )
    return view


def read_speculators(d: dict) -> EngineView:
    """A speculators-format config as vLLM reads it: SpeculatorsConfig.validate_speculators_config,
    extract_transformers_pre_trained_config (transformer_layer_config + update_eagle3)."""
    problems = []
    kind = d.get("speculators_model_type")
    if kind not in ("eagle3", "peagle"):
        problems.append(f"speculators_model_type {kind!r} is not 'eagle3' or 'peagle'")
    if d.get("model_type") != "speculators" and d.get("speculators_config") is None:
        problems.append(
            "neither model_type 'speculators' nor speculators_config: vLLM would not read "
            "this as a speculators model"
        )
    try:
        spec = d["speculators_config"]
        int(spec["proposal_methods"][0]["speculative_tokens"])
        spec["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError, ValueError):
        problems.append(
            "speculators_config lacks proposal_methods[0].speculative_tokens or "
            "verifier.name_or_path (vLLM: 'Invalid speculators config structure')"
        )
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append(
            "transformer_layer_config is missing (vLLM: 'Must provide transformer_layer_config')"
        )
        layer = {}
    merged = dict(layer)
    # algos.py update_eagle3
    merged["draft_vocab_size"] = d.get("draft_vocab_size")
    if d.get("target_hidden_size") is not None:
        merged["target_hidden_size"] = d["target_hidden_size"]
    # NB: update_eagle3 defaults it to True, update_peagle to False
    merged["norm_before_residual"] = d.get("norm_before_residual", kind != "peagle")
    merged["architectures"] = [
        "Eagle3LlamaForCausalLM"
    ]  # PeagleLlamaForCausalLM is registered as it too
    if (
        kind == "peagle"
    ):  # update_peagle: mask_token_id (required) -> pard_token; method eagle3 + parallel
        if d.get("mask_token_id") is None:
            problems.append(
                "a peagle speculators config without mask_token_id (vLLM: KeyError in update_peagle)"
            )
        else:
            merged["pard_token"] = d["mask_token_id"]
    if d.get("eagle_aux_hidden_state_layer_ids"):
        merged["eagle_aux_hidden_state_layer_ids"] = d["eagle_aux_hidden_state_layer_ids"]
    # The model reads fc_norm / norm_output with getattr on this merged config; update_eagle3 copies
    # them from the top level only in some vLLM versions, so both places must agree.
    for flag in ("fc_norm", "norm_output", "norm_before_fc"):
        if bool(d.get(flag, False)) != bool(layer.get(flag, False)):
            problems.append(
                f"{flag} is {d.get(flag)} at the top level but {layer.get(flag)} in "
                "transformer_layer_config: vLLM versions read different ones"
            )
    view = read_vllm(merged, engine="speculators")
    view.problems = problems + view.problems
    return view


# ----------------------------------------------------------------------------- parameters


def full_vocab(v: EngineView) -> bool:
    """The draft proposes over the whole target vocabulary (draft_vocab_size == vocab_size). vLLM
    (Eagle3LlamaForCausalLM.__init__, compared with the target's vocab size, which config.json's vocab_size
    is) then builds no draft_id_to_target_id: the lm_head's rows are the target ids themselves."""
    return v.draft_vocab_size == v.vocab_size


def vllm_params(v: EngineView) -> dict[str, tuple[int, ...]]:
    """Eagle3LlamaForCausalLM's parameters that must come from the file, with their shapes.
    q/k/v and gate/up are listed as the shards load_weights' stacked_params_mapping routes into the
    fused qkv_proj / gate_up_proj."""
    H, Ht, I = v.hidden_size, v.target_hidden_size, v.intermediate_size
    q, kv = v.num_attention_heads * v.head_dim, v.num_key_value_heads * v.head_dim
    p = {"lm_head.weight": (v.draft_vocab_size, H), "model.norm.weight": (H,)}
    if not full_vocab(
        v
    ):  # Eagle3LlamaForCausalLM.__init__ builds the map only for a smaller draft vocab
        p["draft_id_to_target_id"] = (v.draft_vocab_size,)
    if v.use_aux_hidden_state:
        p["model.fc.weight"] = (H, 3 * Ht)
    if v.fc_norm:
        p.update({f"model.fc_norm.{j}.weight": (Ht,) for j in range(3)})
    if v.norm_before_fc:
        p["model.input_norm.weight"] = (3 * Ht,)
    if v.parallel_drafting:  # load_weights: "mask_hidden not found in weights" is a load error
        p["mask_hidden"] = (1, 1, 3 * Ht)
    for i in range(v.num_hidden_layers):
        d_in = 2 * H if i == 0 else H  # the first layer reads cat(embeds, hidden)
        pre = f"model.layers.{i}."
        p.update(
            {
                pre + "input_layernorm.weight": (H,),
                pre + "post_attention_layernorm.weight": (H,),
                pre + "self_attn.q_proj.weight": (q, d_in),
                pre + "self_attn.k_proj.weight": (kv, d_in),
                pre + "self_attn.v_proj.weight": (kv, d_in),
                pre + "self_attn.o_proj.weight": (H, q),
                pre + "mlp.gate_proj.weight": (I, H),
                pre + "mlp.up_proj.weight": (I, H),
                pre + "mlp.down_proj.weight": (H, I),
            }
        )
        if i == 0:
            p[pre + "hidden_norm.weight"] = (H,)
    return p


def vllm_optional(v: EngineView) -> dict[str, tuple[int, ...]]:
    """Parameters vLLM loads when present but does not need: embed_tokens (else the target's is shared,
    load_eagle_model) and the unused hidden_norm of layers after the first."""
    p = {"model.embed_tokens.weight": (v.vocab_size, v.hidden_size)}
    p.update(
        {
            f"model.layers.{i}.hidden_norm.weight": (v.hidden_size,)
            for i in range(1, v.num_hidden_layers)
        }
    )
    return p


def speculators_optional(v: EngineView) -> dict[str, tuple[int, ...]]:
    """vLLM's optional parameters, and the t2d mask the speculators library reads (route_speculators)."""
    return {**vllm_optional(v), **({} if full_vocab(v) else {"t2d": (v.vocab_size,)})}


def sglang_params(v: EngineView) -> dict[str, tuple[int, ...]]:
    """LlamaForCausalLMEagle3's parameters (newer module names: model.layers.0 = the older model.midlayer)
    plus hot_token_id, which load_weights builds from d2t. It is needed at every draft vocab size: without
    d2t newer SGLang maps draft ids as target ids (right only for the full vocab), and older releases'
    EAGLE-3 worker calls `get_hot_token_id().to(...)` unconditionally, which fails on None."""
    H, Ht, I = v.hidden_size, v.target_hidden_size, v.intermediate_size
    q, kv = v.num_attention_heads * v.head_dim, v.num_key_value_heads * v.head_dim
    pre = "model.layers.0."
    p = {
        "lm_head.weight": (v.draft_vocab_size, H),
        "model.norm.weight": (H,),
        "model.fc.weight": (H, 3 * Ht),
        "hot_token_id": (v.draft_vocab_size,),
        pre + "input_layernorm.weight": (H,),
        pre + "hidden_norm.weight": (H,),
        pre + "post_attention_layernorm.weight": (H,),
        pre + "self_attn.q_proj.weight": (q, 2 * H),
        pre + "self_attn.k_proj.weight": (kv, 2 * H),
        pre + "self_attn.v_proj.weight": (kv, 2 * H),
        pre + "self_attn.o_proj.weight": (H, q),
        pre + "mlp.gate_proj.weight": (I, H),
        pre + "mlp.up_proj.weight": (I, H),
        pre + "mlp.down_proj.weight": (H, I),
    }
    if v.fc_norm:
        p.update({f"model.fc_norm.{j}.weight": (Ht,) for j in range(3)})
    return p


# ----------------------------------------------------------------------------- routing file keys


def route_vllm(key: str, v: EngineView) -> Route:
    """Eagle3LlamaForCausalLM.load_weights, then LlamaModel's "midlayer." -> "layers.0." mapping and
    AutoWeightsLoader (which raises on a name the model does not have)."""
    if "t2d" in key:
        return Route("skipped", why='vLLM drops t2d (`if "t2d" in name: continue`)')
    if "d2t" in key:
        if full_vocab(v):
            return Route(
                "rejected",
                why="vLLM has no draft_id_to_target_id when draft_vocab_size equals "
                'vocab_size, and its loader fails on the key ("There is no module or '
                "parameter named 'draft_id_to_target_id'\")",
            )
        return Route("param", "draft_id_to_target_id")
    if "mask_hidden" in key:
        if v.parallel_drafting:  # copied into the mask_hidden buffer
            return Route("param", "mask_hidden")
        return Route("skipped", why="mask_hidden is only read for parallel drafting")
    name = key if "lm_head" in key else "model." + key
    name = name.replace("midlayer.", "layers.0.")
    if name in vllm_params(v) or name in vllm_optional(v):
        return Route("param", name)
    return Route("rejected", why=f"vLLM has no parameter {name}: AutoWeightsLoader fails on it")


def route_speculators(key: str, v: EngineView) -> Route:
    if "t2d" in key:
        if full_vocab(v):  # DraftVocabMixin._init_vocab: use_draft_vocab False, no vocab buffers
            return Route(
                "skipped",
                why="vLLM drops t2d, and the speculators library keeps none when the "
                "draft's vocab is the target's",
            )
        # vLLM drops it; the speculators library reads it (Eagle3DraftModel vocab buffers).
        return Route("param", "t2d")
    return route_vllm(key, v)


def route_sglang(key: str, v: EngineView) -> Route:
    """LlamaForCausalLMEagle3.load_weights: d2t -> hot_token_id, t2d dropped, `name` or `model.name`
    if the model has it, anything else SILENTLY skipped."""
    if "d2t" in key:
        return Route("param", "hot_token_id")
    if "t2d" in key:
        return Route("skipped", why='SGLang drops t2d (`if "t2d" in name: continue`)')
    if key.startswith("layers."):
        return Route(
            "skipped",
            why=f"older SGLang (a `midlayer` module) silently skips {key}; "
            "only `midlayer.*` loads in every version",
        )
    name = key.replace("midlayer", "layers.0")  # newer loader's legacy_name_map
    name = name if name in sglang_params(v) else "model." + name
    if name == "model.embed_tokens.weight":
        return Route(
            "skipped", why="SGLang replaces the draft's embed_tokens with the target's (set_embed)"
        )
    if name in sglang_params(v):
        return Route("param", name)
    return Route("skipped", why=f"SGLang silently skips {key}: no parameter {name}")


# ----------------------------------------------------------------------------- vocab and aux layers


def draft_to_target(engine_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The target id the engine emits for each draft id [Vd]."""
    if engine_name == "hot_token_id":
        return tensor.long()  # SGLang: hot_token_id = d2t + arange, indexed by draft id
    # vLLM compute_logits: targets = arange(draft_vocab_size) + draft_id_to_target_id
    return vocab_map.ids_from_d2t(tensor)


def hot_token_id(d2t: torch.Tensor) -> torch.Tensor:
    """SGLang load_weights: `hot_token_id = loaded_weight + torch.arange(loaded_weight.shape[0])`."""
    return vocab_map.ids_from_d2t(d2t)


def captured_layer_outputs(
    v: EngineView, num_layers: int, target_architecture: str
) -> tuple[list[int], str | None]:
    """The target layers (as 0-indexed layer OUTPUTS) whose states the engine feeds the draft, in the
    order it concatenates them, or a problem."""
    N = num_layers
    if v.engine in ("vllm", "speculators"):
        # llama.py get_eagle3_aux_hidden_state_layers default; LlamaModel.forward captures the INPUT of
        # layer idx for idx in range(N), in loop order.
        ids = v.aux_ids if v.aux_ids is not None else [2, N // 2, N - 3]
        inputs = sorted(set(ids))
    else:
        if v.aux_ids is None:
            inputs = sorted({2, N // 2, N - 3})  # set_eagle3_layers_to_capture(None): no shift
        elif target_architecture == "GptOssForCausalLM":
            return (
                [],
                "SGLang reads a GPT-OSS target's aux ids as hidden-state boundaries (PR 32334)",
            )
        elif target_architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM") or v.aux_ids[0] == 1:
            # llama.py / qwen3.py: val + 1 always; deepseek_v2.py: val + 1 when the first id is 1
            inputs = sorted({i + 1 for i in v.aux_ids})
        else:
            return [], (
                f"SGLang's reading of aux ids {v.aux_ids} (first id not 1) depends on the "
                f"{target_architecture or 'target'} model file"
            )
    missed = [k for k in inputs if not 1 <= k < N]
    if missed:
        return (
            [],
            f"the engine never captures layer inputs {missed} (it records inputs of layers 0..{N - 1})",
        )
    return [k - 1 for k in inputs], None


def to_draft_key(engine_name: str) -> str | None:
    """The engine's parameter -> spec_cli's Eagle3Draft state key (None: loaded but unused)."""
    if engine_name in ("draft_id_to_target_id", "hot_token_id"):
        return "d2t"
    if engine_name in ("lm_head.weight", "t2d"):
        return engine_name
    if engine_name == "mask_hidden":
        return "mask_hidden.weight"
    name = engine_name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0.") :]
    if name.startswith("layers.") and name.endswith(".hidden_norm.weight"):
        return None  # layers after the first have a hidden_norm the forward never uses
    return name


ENGINES = {
    "vllm": (read_vllm, vllm_params, vllm_optional, route_vllm),
    "sglang": (read_sglang, sglang_params, lambda v: {}, route_sglang),
    "speculators": (read_speculators, vllm_params, speculators_optional, route_speculators),
}
