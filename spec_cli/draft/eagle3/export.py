"""EAGLE-3's writer: a draft checkpoint -> the config.json and model.safetensors each engine loads as is.

Every rule below comes from the engine's current loader (file and function named at the rule). The
self-check (`spec_cli/export/check.py`) does not use this module: it reads the folder back with its
own tables of what each engine expects (`spec_cli/export/engines.py`), so a mistake here cannot hide itself.

spec_cli's own convention for the aux layers (DraftConfig.aux_layer_ids) is "0-indexed decoder layer
OUTPUT". The engines count differently:

    spec_cli id i  ==  output of layer i  ==  input of layer i + 1
    vLLM id        =   i + 1   (vLLM captures the input of layer k, used as is)
    SGLang id      =   i       (SGLang adds 1 and captures the input of layer i + 1)
"""

from __future__ import annotations

import torch

from spec_cli.draft.contract import DTYPE_NAMES, Checkpoint, ExportFiles, provenance
from spec_cli.errors import ExportError

FORMATS = ("vllm", "sglang", "speculators")

# SGLang target models whose set_eagle3_layers_to_capture adds 1 to EVERY explicit id:
# python/sglang/srt/models/llama.py and qwen3.py (`layers_to_capture = [val + 1 for val in layer_ids]`).
# Others differ: deepseek_v2.py adds 1 only when the first id is 1 (sglang PR 25454), and GPT-OSS
# reads the ids as hidden-state boundaries (sglang PR 32334).
SGLANG_ALWAYS_PLUS_ONE = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM"})
SGLANG_BOUNDARY_IDS = frozenset({"GptOssForCausalLM"})

# Draft steps per verification in the README's serving command (SGLang's usual 3/1/4 EAGLE-3 setting;
# never deeper than the TTT unroll the draft was trained with).
SERVING_STEPS = 3


def build(src: Checkpoint, fmt: str, dtype: torch.dtype) -> ExportFiles:
    """The files of `fmt` for this checkpoint. Raises ExportError where the engine cannot serve the
    draft as it was trained."""
    refuse_unservable(src, fmt)
    order = sorted(range(3), key=lambda j: src.config.aux_layer_ids[j])
    outputs = [src.config.aux_layer_ids[j] for j in order]
    tensors = _engine_tensors(src, fmt, order, dtype)
    steps = min(SERVING_STEPS, src.ttt_steps or SERVING_STEPS)
    if fmt == "vllm":
        ids = vllm_aux_ids(outputs)
        config = _vllm_config(src, ids, dtype)
    elif fmt == "sglang":
        ids = sglang_aux_ids(outputs)
        config = _sglang_config(src, ids, dtype)
    else:
        ids = vllm_aux_ids(outputs)
        config = _speculators_config(src, ids, dtype, steps)
    config["spec_cli"] = provenance(src, fmt, dtype)
    return ExportFiles(
        format=fmt,
        config=config,
        tensors=tensors,
        engine_aux_ids=ids,
        aux_layer_outputs=outputs,
        num_speculative_tokens=steps,
    )


# ----------------------------------------------------------------------------- aux layer ids


def vllm_aux_ids(layer_outputs: list[int]) -> list[int]:
    """spec_cli ids -> vLLM's `eagle_aux_hidden_state_layer_ids`.

    vllm/model_executor/models/llama.py LlamaModel.forward appends `hidden_states + residual` for
    `idx in self.aux_hidden_state_layers` BEFORE running layer idx (the input of layer idx), and
    vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config passes the
    config's ids through unchanged (its default (2, N//2, N-3) == spec_cli's (1, N//2-1, N-4))."""
    return [i + 1 for i in layer_outputs]


def sglang_aux_ids(layer_outputs: list[int]) -> list[int]:
    """spec_cli ids -> SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`.

    python/sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture sets
    `layers_to_capture = [val + 1 for val in layer_ids]` ("for the ith layer, it takes the output of
    the (i-1)th layer") and LlamaModel.forward captures the input of those layers: SGLang's explicit
    ids already mean "output of layer i", spec_cli's convention."""
    return list(layer_outputs)


# ----------------------------------------------------------------------------- what cannot be served


def refuse_unservable(src: Checkpoint, fmt: str) -> None:
    """Raise ExportError for options the engine cannot represent (it would load and serve wrongly)."""
    c = src.config
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    if c.hidden_act != "silu":
        # vLLM/SGLang LlamaMLP: SiluAndMul only.
        raise ExportError(
            f"the draft uses hidden_act {c.hidden_act!r}; the engines' Llama MLP is silu only",
            "train the draft with the default activation",
        )
    last = c.target_num_layers - 2
    late = [i for i in c.aux_layer_ids if not 0 <= i <= last]
    if late:
        # Both engines capture aux states BEFORE running a layer (vLLM llama.py LlamaModel.forward,
        # SGLang llama.py LlamaModel.forward), so the output of the last layer is never captured.
        raise ExportError(
            f"aux layer(s) {late} cannot be captured by the engines: they record the input of "
            f"layers 0..{c.target_num_layers - 1}, i.e. outputs of layers 0..{last}",
            f"retrain with --aux-layers in 0..{last}",
        )
    if fmt != "sglang":
        return
    if c.sliding_window is not None:
        # python/sglang/srt/models/llama.py LlamaAttention builds RadixAttention without a sliding window and
        # reads neither sliding_window nor layer_types; llama_eagle3.py (sglang 0.5.23) sets one only from the
        # server flag --speculative-draft-window-size, which counts one key more than vLLM's window (its
        # backends take it as the keys left of the query). A folder cannot make SGLang serve the window.
        raise ExportError(
            f"the draft was trained with --draft-window {c.sliding_window}; SGLang reads no window "
            "from a draft's config.json and would attend the whole context",
            "export it with --format vllm or speculators; or train without --draft-window for "
            "SGLang (recent SGLang has --speculative-draft-window-size, which counts one key "
            f"more: {c.sliding_window - 1} would match)",
        )
    if c.num_hidden_layers != 1:
        # python/sglang/srt/models/llama_eagle3.py: older versions build extra layers as
        # `additional_layers` (BasicDecoderLayer, which drops the incoming residual) and silently skip
        # `layers.*` keys; newer ones name them `layers.{i}` with `hidden_norm` as the input norm.
        raise ExportError(
            f"the draft has {c.num_hidden_layers} decoder layers; SGLang's EAGLE-3 model "
            "computes and names extra layers differently across versions (llama_eagle3.py)",
            "export it with --format vllm, or train a 1-layer draft for SGLang",
        )
    arch = c.target_architecture
    if arch in SGLANG_BOUNDARY_IDS:
        raise ExportError(
            f"SGLang reads the aux layer ids of a {arch} target as hidden-state boundaries "
            "(sglang PR 32334), a convention spec_cli does not write",
            "export it with --format vllm",
        )
    first = min(c.aux_layer_ids)
    if first != 1 and arch not in SGLANG_ALWAYS_PLUS_ONE:
        raise ExportError(
            f"SGLang's reading of aux layer ids whose first id is {first} (not 1) depends on "
            f"the target's model file (llama.py adds 1, deepseek_v2.py does not), and "
            f"{arch or 'this target'} is not one spec_cli has verified",
            _first_layer_hint(c),
        )


def _first_layer_hint(c) -> str:
    """What to do about aux layers SGLang may misread: the layers whose first is 1 on this target, where
    three distinct capturable ones (outputs of layers 1 .. N - 2) exist, else the vLLM export."""
    from spec_cli.draft.eagle3 import default_aux_layers

    last = c.target_num_layers - 2
    if last < len(c.aux_layer_ids):  # layers 1 .. last are too few: the first must be layer 0
        return (
            f"a {c.target_num_layers}-layer target has outputs of layers 0..{last} to read, too few for "
            f"{len(c.aux_layer_ids)} distinct layers from layer 1: export it with --format vllm"
        )
    ids = default_aux_layers(c.target_num_layers)
    if min(ids) != 1:
        ids = sorted(
            {
                round(1 + i * (last - 1) / (len(c.aux_layer_ids) - 1))
                for i in range(len(c.aux_layer_ids))
            }
        )
    return f"train with --aux-layers {','.join(map(str, ids))} (the first is layer 1) or export --format vllm"


# ----------------------------------------------------------------------------- tensors


def _engine_tensors(src: Checkpoint, fmt: str, order: list[int], dtype: torch.dtype) -> dict:
    """Checkpoint tensors -> the engine's file keys: float weights cast to `dtype`, d2t int64, t2d bool."""
    state = dict(src.state)
    # The engines concatenate the aux states in ascending layer order (the capture loops run over the
    # layers in order), so fc's column blocks and the fc_norm list follow that order.
    Ht = src.config.target_hidden_size
    blocks = state["fc.weight"].split(Ht, dim=1)  # 3 x [H, Ht]
    state["fc.weight"] = torch.cat([blocks[j] for j in order], dim=1)
    if src.config.fc_norm:
        norms = [state[f"fc_norm.{j}.weight"] for j in range(3)]
        for new, old in enumerate(order):
            state[f"fc_norm.{new}.weight"] = norms[old]
    # The engines embed with the TARGET's table, which the draft's frozen copy equals: vLLM shares it
    # when the file has none (vllm/v1/worker/gpu/spec_decode/eagle/utils.py load_eagle_model,
    # has_own_embed_tokens), SGLang replaces it anyway (eagle_worker.py: draft model .set_embed(embed)).
    # The speculators library cannot do without it: speculators 0.9.0 marks its embedding initialised
    # and, under transformers 5 (meta-device init), is left with uninitialised memory when the file has
    # none; its own checkpoints keep it, and vLLM drops a copy equal to the target's.
    if fmt != "speculators":
        del state["embed_tokens.weight"]
    if fmt != "speculators":
        # vLLM (llama_eagle3.py Eagle3LlamaForCausalLM.load_weights) and SGLang
        # (LlamaForCausalLMEagle3.load_weights) both `continue` on "t2d"; the speculators library reads it.
        del state["t2d"]
    if src.config.draft_vocab_size == src.config.vocab_size and fmt != "sglang":
        # The whole target vocab: the vocab map is the identity (vocab_map.select_token_ids) and vLLM
        # (llama_eagle3.py Eagle3LlamaForCausalLM.__init__) builds no draft_id_to_target_id, so its loader
        # fails on a d2t key; the speculators library keeps no d2t/t2d buffers either (DraftVocabMixin:
        # use_draft_vocab False). SGLang keeps its d2t: older releases need a hot_token_id at any size.
        del state["d2t"]
        state.pop("t2d", None)
    if fmt == "speculators":
        # speculators' Eagle3 model keeps its decoder layers in `layers` (layers.0 is the EAGLE layer);
        # vLLM then loads them as model.layers.* without any renaming.
        state = {
            k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v
            for k, v in state.items()
        }
    # vllm/sglang: `midlayer.*` as trained. vLLM maps it to layers.0 (LlamaModel.load_weights /
    # hf_to_vllm_mapper); SGLang's older model has a `midlayer` module, the newer maps it to layers.0.
    out = {}
    for key, value in state.items():
        if key == "d2t":
            out[key] = value.to(torch.int64).contiguous()  # offsets: target = draft + d2t[draft]
        elif key == "t2d":
            out[key] = value.to(torch.bool).contiguous()
        else:
            out[key] = value.to(dtype).contiguous()
    return out


# ----------------------------------------------------------------------------- config.json


def _rope(c) -> dict:
    """Rope in both spellings: `rope_theta` + `rope_scaling` (transformers 4.x, older engines) and
    `rope_parameters` (transformers 5.x; vLLM's patch_rope_parameters builds it from the former)."""
    scaling = dict(c.rope_scaling) if c.rope_scaling else None
    if scaling and "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    parameters = {**(scaling or {"rope_type": "default"}), "rope_theta": c.rope_theta}
    return {"rope_theta": c.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def llama_layer(src: Checkpoint, dtype: torch.dtype) -> dict:
    """The Llama decoder-layer config every engine builds the draft layer from (LlamaConfig fields)."""
    c = src.config
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        **_rope(c),
        "vocab_size": c.vocab_size,  # the TARGET vocab: embed_tokens rows and the d2t range
        "tie_word_embeddings": False,  # SGLang: True would make lm_head = embed_tokens [V, H]
        "attention_bias": False,  # vLLM llama_eagle3.py: qkv bias = config.attention_bias
        "mlp_bias": False,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def window_fields(c) -> dict:
    """--draft-window: vLLM's LlamaAttention (llama.py) gives a draft layer i `per_layer_sliding_window =
    sliding_window` when `layer_types[i]` is "sliding_attention" (Eagle3LlamaForCausalLM sets
    `target_layer_count`, so i counts the draft's own layers); a query at position p then attends keys at
    positions > p - W, as trained (its CPU kernel and FlashAttention's (W - 1, 0) window alike). The
    speculators format's transformer_layer_config is copied into vLLM's config as is (speculators/base.py),
    so the same fields work there. `use_sliding_window` is read by neither; speculators writes it, so do we."""
    if c.sliding_window is None:
        return {}
    return {
        "sliding_window": c.sliding_window,
        "use_sliding_window": True,
        "layer_types": ["sliding_attention"] * c.num_hidden_layers,
    }


def _vllm_config(src: Checkpoint, aux_ids: list[int], dtype: torch.dtype) -> dict:
    """vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM, LlamaModel)."""
    c = src.config
    return {
        # registered in vllm/model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS; SGLang does
        # not know this name, so pointing SGLang at this folder fails loudly instead of serving wrongly.
        "architectures": ["Eagle3LlamaForCausalLM"],
        **llama_layer(src, dtype),
        "draft_vocab_size": c.draft_vocab_size,  # absent -> vLLM uses vocab_size for lm_head
        "target_hidden_size": c.target_hidden_size,  # fc input = 3 * target_hidden_size
        # read by get_eagle3_aux_layers_from_config (top level only), used as is
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        # LlamaDecoderLayer: residual = un-normed hidden (`_norm_after_residual`), as trained
        "norm_before_residual": False,
        "norm_before_fc": False,  # no single RMSNorm over the concatenated aux states
        # EAGLE-3.1: `fc_norm` -> one RMSNorm per aux chunk (combine_hidden_states);
        # `norm_output` -> LlamaModel.forward feeds the post-norm state to the next draft step.
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        **window_fields(c),
    }


def _sglang_config(src: Checkpoint, aux_ids: list[int], dtype: torch.dtype) -> dict:
    """python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3) and model_runner.py."""
    c = src.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],  # llama_eagle3.py EntryClass
        **llama_layer(src, dtype),
        # None would set load_lm_head_from_target and serve the target's full lm_head instead
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        # model_runner.py reads ONLY eagle_config["eagle_aux_hidden_state_layer_ids"] (a top-level key
        # is ignored and the target's default layers are used)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
        # EAGLE-3.1 (LlamaModel): `fc_norm` -> per-chunk RMSNorm before fc; `norm_output` -> the
        # post-norm state is returned as the next step's hidden state. Older SGLang ignores both.
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
    }


def _speculators_config(
    src: Checkpoint, aux_ids: list[int], dtype: torch.dtype, steps: int
) -> dict:
    """vllm-project/speculators Eagle3SpeculatorConfig, as vLLM reads it:
    vllm/transformers_utils/configs/speculators/base.py SpeculatorsConfig (validate_speculators_config,
    extract_transformers_pre_trained_config) + algos.py update_eagle3."""
    c = src.config
    layer = llama_layer(src, dtype)
    # update_eagle3 builds vLLM's config from transformer_layer_config and copies only draft_vocab_size,
    # target_hidden_size, norm_before_residual and the aux ids; the EAGLE-3.1 flags are read from the
    # layer config (LlamaModel getattr), so they go there too, not only at the top level.
    layer.update(
        {
            "fc_norm": c.fc_norm,
            "norm_output": c.norm_output,
            "norm_before_fc": False,
            **window_fields(c),
        }
    )
    return {
        "architectures": ["Eagle3Speculator"],
        "model_type": "speculators",  # vLLM's HF config parser -> SpeculatorsConfig
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        # update_eagle3 defaults this to TRUE when absent (speculators' own default is False)
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": aux_ids,  # vLLM convention (speculators data comes from vLLM)
        "tie_word_embeddings": False,
        "speculators_config": speculators_block(src, "eagle3", steps),
    }


def speculators_block(src: Checkpoint, algorithm: str, steps: int) -> dict:
    """The `speculators_config` vLLM reads (base.py validate_speculators_config): the proposal method's
    speculative tokens and the verifier's name."""
    c = src.config
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": steps,
                "accept_tolerance": 0.0,
                "verifier_accept_k": 1,
            }
        ],
        "verifier": {
            "name_or_path": src.target or "TARGET",
            "architectures": [c.target_architecture] if c.target_architecture else [],
        },
    }
