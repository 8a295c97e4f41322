"""The self-check of an EAGLE-1/2 export: the folder read back the way vLLM (`method: "eagle"`,
model_executor/models/llama_eagle.py EagleLlamaForCausalLM) and SGLang (`EAGLE`, llama_eagle.py
LlamaForCausalLMEagle) load it, from tables written from those loaders, not from the writer
(spec_cli/draft/eagle/export.py). Neither engine reports a missing key (vLLM's load_weights returns
None; SGLang warns only of unknown ones), so this check is the only place a hole would show.

    1. config    the class the engine picks, the draft's shapes and rope as the engine reads them, and
                 no switch that makes the engine build weights nothing loads (attention_bias / bias /
                 mlp_bias), tie_word_embeddings false (SGLang's set_embed_and_head)
    2. keys      exactly the parameters the engine loads: fc.weight, layers.{i}.* with an input norm
                 only for i >= 1; SGLang also fc.bias, which must be zero (trained without one); no
                 embed_tokens / lm_head / norm (the target's are shared, a file copy is an error or
                 ignored)
    3. shapes    each tensor as the engine allocates it from that config
    4. predict   the draft built from the files (with the target's embedding and head) and the
                 checkpoint cast to the export dtype give the same logits on random features for two
                 steps (the second reads the draft's own output, as served), and the same argmax as the
                 fp32 checkpoint where its margin is not tiny
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle.model import EagleDraft
from spec_cli.errors import ArtifactError, ConfigError, ExportCheckError
from spec_cli.export.check import CheckReport, passed
from spec_cli.export.reader import ReadExport, template_record
from spec_cli.targets import loading

# the class each engine builds (vLLM EAGLEConfig prefixes "Eagle" to LlamaForCausalLM; SGLang's EntryClass)
CLASSES = {
    "vllm": ("EagleLlamaForCausalLM", "LlamaForCausalLM"),
    "sglang": ("LlamaForCausalLMEagle",),
}
LAYER = {  # llama.py LlamaDecoderLayer parameters, by the config fields that size them
    "self_attn.q_proj.weight": lambda c: (
        c["num_attention_heads"] * c["head_dim"],
        c["hidden_size"],
    ),
    "self_attn.k_proj.weight": lambda c: (
        c["num_key_value_heads"] * c["head_dim"],
        c["hidden_size"],
    ),
    "self_attn.v_proj.weight": lambda c: (
        c["num_key_value_heads"] * c["head_dim"],
        c["hidden_size"],
    ),
    "self_attn.o_proj.weight": lambda c: (
        c["hidden_size"],
        c["num_attention_heads"] * c["head_dim"],
    ),
    "mlp.gate_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.up_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.down_proj.weight": lambda c: (c["hidden_size"], c["intermediate_size"]),
    "post_attention_layernorm.weight": lambda c: (c["hidden_size"],),
}
FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
)
STEPS = 2


def engine_shapes(fmt: str, c: dict) -> dict[str, tuple[int, ...]]:
    """The file keys the engine loads and the shape it allocates for each."""
    H = c["hidden_size"]
    shapes = {"fc.weight": (H, 2 * H)}
    if fmt == "sglang":
        shapes["fc.bias"] = (H,)
    for i in range(c["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{k}": size(c) for k, size in LAYER.items()})
        if i > 0:  # layer 0's input_layernorm is an Identity in both engines
            shapes[f"layers.{i}.input_layernorm.weight"] = (H,)
    return shapes


def check_eagle_export(folder: Path, fmt: str, src, dtype: torch.dtype) -> CheckReport:
    return passed(fmt, *find_problems(Path(folder), fmt, src, dtype))


def find_problems(
    folder: Path, fmt: str, src, dtype: torch.dtype
) -> tuple[list[str], CheckReport | None]:
    try:
        c = json.loads((folder / "config.json").read_text())
        tensors = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        return [f"the files cannot be read ({exc})"], None
    problems = []
    if (c.get("architectures") or [""])[0] not in CLASSES[fmt]:
        problems.append(
            f"architectures {c.get('architectures')} is not what {fmt} builds an EAGLE-1 draft "
            f"from ({CLASSES[fmt][0]})"
        )
    missing = [k for k in FIELDS + ("rope_theta",) if k not in c]
    if missing:
        return problems + [
            f"config.json lacks {missing} (the engine would take LlamaConfig's defaults)"
        ], None
    trained = src.config
    want = {
        "hidden_size": trained.hidden_size,
        "intermediate_size": trained.intermediate_size,
        "num_attention_heads": trained.num_attention_heads,
        "num_key_value_heads": trained.num_key_value_heads,
        "head_dim": trained.head_dim,
        "num_hidden_layers": trained.num_hidden_layers,
        "rms_norm_eps": trained.rms_norm_eps,
        "vocab_size": trained.vocab_size,
        "max_position_embeddings": trained.max_position_embeddings,
    }
    problems += [
        f"{k} is {c[k]} for the engine, {v} in training" for k, v in want.items() if c[k] != v
    ]
    thetas = {c["rope_theta"], (c.get("rope_parameters") or {}).get("rope_theta", c["rope_theta"])}
    if thetas != {trained.rope_theta}:
        problems.append(
            f"rope theta {sorted(thetas)} for the engine, {trained.rope_theta} in training"
        )
    if (c.get("rope_parameters") or {}).get("rope_type", "default") != (
        (trained.rope_scaling or {}).get("rope_type") or "default"
    ):
        problems.append("the engine's rope type differs from the training's")
    problems += [
        f"config.json sets {k}: the engine would build biases nothing loads"
        for k in ("attention_bias", "bias", "mlp_bias", "qkv_bias")
        if c.get(k)
    ]
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c.get('hidden_act')!r}: the engines' Llama MLP is silu only")
    if c.get("tie_word_embeddings"):
        problems.append(
            "tie_word_embeddings is true: SGLang's set_embed_and_head would fail on the shared head"
        )
    if problems:
        return problems, None

    shapes = engine_shapes(fmt, c)
    problems += [
        f"the engine's {k} is not in the file (it would serve its initial values)"
        for k in sorted(set(shapes) - set(tensors))
    ]
    problems += [
        f"the file key {k} is not a parameter of the engine's draft (a load error, or dropped)"
        for k in sorted(set(tensors) - set(shapes))
    ]
    problems += [
        f"{k} is {tuple(tensors[k].shape)}, the engine allocates {shapes[k]}"
        for k in sorted(set(shapes) & set(tensors))
        if tuple(tensors[k].shape) != shapes[k]
    ]
    if "fc.bias" in tensors and bool(tensors["fc.bias"].float().abs().max() > 0):
        problems.append("fc.bias is not zero: the draft was trained without one")
    if problems:
        return problems, None

    # predictions: the draft as the engine builds it from the files, the target's embedding and head
    shared = {k: src.state[k] for k in ("embed_tokens.weight", "lm_head.weight")}
    files = {k: v.float() for k, v in tensors.items() if k != "fc.bias"}
    got = _predict(_draft(trained, {**files, **shared}))
    cast = {k: (v.to(dtype).float() if v.is_floating_point() else v) for k, v in src.state.items()}
    want = _predict(_draft(trained, {**cast, **shared}))
    fp32 = _predict(_draft(trained, dict(src.state)))
    confident = agree = 0
    for k, (g, w, f) in enumerate(zip(got, want, fp32)):
        scale = max(1.0, float(w.abs().max()))
        diff = float((g - w).abs().max())
        if diff > 1e-4 * scale:
            problems.append(
                f"draft step {k}: the export's logits differ from the checkpoint cast to {dtype} "
                f"(max diff {diff:.3g})"
            )
        top = f.topk(2, dim=-1).values
        sure = (top[..., 0] - top[..., 1]) > 0.05 * (1.0 + top[..., 0].abs())
        confident += int(sure.sum())
        agree += int((g.argmax(-1) == f.argmax(-1))[sure].sum())
    agreement = agree / confident if confident else 1.0
    if agreement < 0.9:
        problems.append(
            f"in {dtype} the export agrees with the fp32 checkpoint on only {agreement:.0%} of the "
            "positions where the checkpoint is confident"
        )
    B, T = SHAPE
    return problems, CheckReport(
        format=fmt,
        params_loaded=len(tensors),
        aux_layer_outputs=[],
        positions=B * T * STEPS,
        confident=confident,
        agreement_fp32=agreement,
    )


SHAPE = (2, 12)


def _draft(config: DraftConfig, state: dict[str, torch.Tensor]) -> EagleDraft:
    try:
        draft = EagleDraft(config)
    except ConfigError as exc:  # pragma: no cover - the checkpoint loaded as this config
        raise ExportCheckError(f"the draft cannot be built: {exc.message}", exc.hint) from exc
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    draft.attn_impl = "math"
    return draft.eval()


@torch.no_grad()
def _predict(draft: EagleDraft) -> list[torch.Tensor]:
    """Logits [B, T, V] fp32 of STEPS draft steps on fixed random ids and features: step 0 reads the
    features, step k the draft's own output of step k - 1 (with the ids rolled left by k)."""
    gen = torch.Generator().manual_seed(0)
    B, T = SHAPE
    H, V = draft.config.hidden_size, draft.config.vocab_size
    ids = torch.randint(0, V, (B, T), generator=gen)
    state = torch.randn(B, T, H, generator=gen) * 2
    out = []
    for k in range(STEPS):
        state = draft(torch.roll(ids, -k, dims=1), state)
        out.append(draft.logits(state).float())
    return out


check = check_eagle_export  # Algorithm.export_rules: check, recognise, read


def recognise(raw: dict) -> str | None:
    """vllm / sglang for the config.json of an EAGLE-1/2 export (the class its engine builds), else None."""
    arch = (raw.get("architectures") or [""])[0]
    return next((fmt for fmt, names in CLASSES.items() if arch in names[:1]), None)


def read(folder: Path, fmt: str, target_config) -> ReadExport:
    """An EAGLE-1/2 export, read as its engine reads it: the config's shapes (the ones the self-check
    proves), the file's weights, the target's embedding and lm_head (`spec eval --draft EXPORT`)."""
    c = json.loads((folder / "config.json").read_text())
    block = c.get("spec_cli") if isinstance(c.get("spec_cli"), dict) else {}
    tensors = load_file(str(folder / "model.safetensors"))
    shapes = engine_shapes(fmt, c)
    bad = sorted(set(shapes) ^ set(tensors)) + sorted(
        k for k in shapes if k in tensors and tuple(tensors[k].shape) != shapes[k]
    )
    if bad:
        raise ArtifactError(
            f"the {fmt} engine would not load {folder} as a working draft (keys {bad[:3]})",
            "re-export the checkpoint with `spec export` (its self-check catches these)",
        )
    text = (
        target_config
        if getattr(target_config, "num_hidden_layers", None)
        else getattr(target_config, "text_config", target_config)
    )
    parameters = c.get("rope_parameters") or {}
    scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    config = DraftConfig(
        vocab_size=c["vocab_size"],
        target_hidden_size=c["hidden_size"],
        aux_layer_ids=[],
        target_num_layers=block.get("target_num_layers") or loading.num_layers(target_config),
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        draft_vocab_size=c["vocab_size"],
        num_hidden_layers=c["num_hidden_layers"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=parameters.get("rope_theta", c.get("rope_theta", 10000.0)),
        rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
        max_position_embeddings=c["max_position_embeddings"],
        target_architecture=(getattr(target_config, "architectures", None) or [""])[0],
        target_fingerprint=block.get("target_fingerprint") or "",
        tokenizer_fingerprint=block.get("tokenizer_fingerprint") or "",
        algorithm="eagle",
    )
    if c["hidden_size"] != getattr(text, "hidden_size", None) or c[
        "vocab_size"
    ] != loading.vocab_size(target_config):
        raise ArtifactError(
            f"the export {folder} was made for a target with hidden size {c['hidden_size']} and "
            f"vocab size {c['vocab_size']}",
            "pass --target the model the draft was trained for",
        )
    model = EagleDraft(config)
    # the keys are the engine's (checked above); embed_tokens and lm_head come from the target
    model.load_state_dict(
        {k: v.float() for k, v in tensors.items() if k != "fc.bias"}, strict=False
    )
    recorded = {
        "vocab_size": c["vocab_size"],
        "target_hidden_size": c["hidden_size"],
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
        needs_embeddings=True,
        needs_head=True,
    )
