"""The export self-check: read a written folder back the way its serving engine will (reader.py, the
reader `spec eval` uses too), and compare with the training checkpoint.

    1. files        exactly config.json, model.safetensors (format "pt") and README.md
    2. config       what the engine builds from config.json (engines.read_*) matches the checkpoint:
                    sizes, rope, eps, EAGLE-3.1 flags in the engine's meaning, no norm_before_residual
    3. weights      every file key is loaded (not skipped or rejected), every parameter the engine needs
                    is there with its shape, floats in the requested dtype and finite, d2t int64
    4. vocab        the engine's draft id -> target id equals the checkpoint's selected ids
                    (arange(Vd) + d2t), which must also be exactly the checkpoint's t2d (a draft over the
                    whole target vocab: vLLM reads no map, its ids are the target's)
    5. aux layers   the layers the engine captures, decoded to spec_cli's convention, are the
                    checkpoint's (in the engine's concatenation order)
    6. predictions  the algorithm's draft built from what the engine loaded, and the checkpoint's,
                    run on the same random aux states / ids for two draft steps: same target-id predictions and
                    logits as the checkpoint cast to the export dtype; and the same argmax as the fp32
                    checkpoint wherever its top-1 margin is not tiny
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.artifacts import vocab_map
from spec_cli.draft import algorithms
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.layers import rope_inv_freq
from spec_cli.errors import ConfigError, ExportCheckError, listing
from spec_cli.export import engines, reader
from spec_cli.export.source import DraftSource

EXPECTED_FILES = {"config.json", "model.safetensors", "README.md"}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class CheckReport:
    format: str
    params_loaded: int
    aux_layer_outputs: list[
        int
    ]  # what the engine feeds the draft, spec_cli convention, engine order
    positions: int  # (draft step, position) pairs compared
    confident: int  # of which the fp32 checkpoint's top-1 margin is not tiny
    agreement_fp32: (
        float  # share of those where the export's prediction equals the fp32 checkpoint's
    )


def check_export(folder: Path, fmt: str, src: DraftSource, dtype: torch.dtype) -> CheckReport:
    """Raise ExportCheckError listing what the engine would load wrongly; else return the report."""
    return passed(fmt, *find_problems(folder, fmt, src, dtype))


def tensor_problems(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, fp32: tuple[str, ...] = ()
) -> list[str]:
    """The file's tensors as the engine needs them: d2t int64 offsets, t2d a bool mask, the weights in the
    requested dtype (those whose names start with one of `fp32`: in fp32, as the engine builds them) and
    finite."""
    problems = []
    for key, tensor in tensors.items():
        want = torch.float32 if key.startswith(fp32) and fp32 else dtype
        if key == "d2t" and tensor.dtype != torch.int64:
            problems.append(f"d2t is {tensor.dtype}, not int64 offsets")
        elif key == "t2d" and tensor.dtype != torch.bool:
            problems.append(f"t2d is {tensor.dtype}, not a bool mask")
        elif key not in ("d2t", "t2d"):
            if tensor.dtype != want:
                problems.append(
                    f"{key} is {tensor.dtype}, not the {'requested ' if want == dtype else ''}{want}"
                )
            elif not bool(torch.isfinite(tensor.float()).all()):
                problems.append(f"{key} has inf/nan values in {want}")
    return problems


def passed(fmt: str, problems: list[str], report: CheckReport | None) -> CheckReport:
    """The report of a self-check that found nothing; else ExportCheckError listing what it found."""
    if problems:
        raise ExportCheckError(
            f"the {fmt} export would not serve as trained: " + listing(problems),
            "nothing was written to the output folder; rerun with SPEC_DEBUG=1 and "
            "report this, or export another checkpoint",
        )
    return report


def compare_predictions(
    got: list, want: list, fp32: list, dtype: torch.dtype, label: str, first: int = 0
) -> tuple[list[str], int, float]:
    """The export's (logits, target ids) per step against the checkpoint cast to `dtype` (same logits,
    same ids wherever the top-1 margin is not tiny) and against the fp32 checkpoint (same top-1 on 90% of
    the positions where it is confident). -> (problems, confident positions, agreement)."""
    problems = []
    for k, ((g_logits, g_ids), (w_logits, w_ids)) in enumerate(zip(got, want)):
        scale = max(1.0, float(w_logits.abs().max()))
        diff = float((g_logits - w_logits).abs().max())
        sure = _margin(w_logits) > 1e-4 * scale  # positions not decided by float summation order
        if diff > 1e-4 * scale or not torch.equal(g_ids[sure], w_ids[sure]):
            problems.append(
                f"{label.format(k + first)}: the export's predictions differ from the checkpoint cast to "
                f"{dtype} (max logit diff {diff:.3g}, "
                f"{int((g_ids != w_ids)[sure].sum())} target ids differ)"
            )
    confident = agree = 0
    for (_, g_ids), (w_logits, w_ids) in zip(got, fp32):
        sure = _margin(w_logits) > 0.05 * (1.0 + w_logits.max(-1).values.abs())
        confident += int(sure.sum())
        agree += int((g_ids == w_ids)[sure].sum())
    agreement = agree / confident if confident else 1.0
    if agreement < 0.9:
        problems.append(
            f"in {dtype} the export agrees with the fp32 checkpoint on only {agreement:.0%} of "
            "the positions where the checkpoint is confident"
        )
    return problems, confident, agreement


def find_problems(
    folder: Path, fmt: str, src: DraftSource, dtype: torch.dtype
) -> tuple[list[str], CheckReport | None]:
    folder = Path(folder)
    present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    problems = [f"{name} is missing" for name in sorted(EXPECTED_FILES - present)]
    problems += [f"{name} is not read by the engine" for name in sorted(present - EXPECTED_FILES)]
    if not {"config.json", "model.safetensors"} <= present:
        return problems, None
    try:
        engine = reader.read(folder, fmt)
    except reader.Unreadable as exc:
        return problems + [f"the files cannot be read ({exc})"], None
    if engine.meta.get("format") != "pt":
        problems.append(
            "model.safetensors lacks the metadata format 'pt' transformers loaders require"
        )

    view = engine.view
    problems += view.problems
    problems += _config_problems(view, src.config)
    if view.hidden_size == 0:
        return problems, None

    # -- weights: every file key loaded by the engine's loader, none skipped -----------------------
    problems += [f"'{key}': {r.why}" for key, r in engine.unloaded.items()]
    problems += [
        f"the engine's {name} is not in the file (it keeps its initial value: random "
        "weights, or an identity vocab map)"
        for name in engine.missing
    ]
    problems += engine.misshapen
    problems += tensor_problems(engine.tensors, dtype)

    # -- vocab -----------------------------------------------------------------------------------
    selected = _checkpoint_selected_ids(src)
    if selected is None:
        problems.append("the checkpoint's d2t and t2d disagree")
    loaded, V = engine.loaded, view.vocab_size
    targets = engine.targets
    if (
        targets is not None
        and selected is not None
        and (targets.shape != selected.shape or not torch.equal(targets, selected))
    ):
        wrong = (
            int((targets != selected).sum()) if targets.shape == selected.shape else targets.numel()
        )
        problems.append(
            f"draft ids map to the wrong target ids ({wrong} of {targets.numel()} differ; "
            "arange instead of offsets, or a zeroed/damaged d2t)"
        )
    if "t2d" in loaded and selected is not None and loaded["t2d"].shape == (V,):
        if not torch.equal(vocab_map.ids_from_t2d(loaded["t2d"]), selected):
            problems.append("t2d does not mark exactly the draft vocabulary's target ids")

    # -- aux layers ------------------------------------------------------------------------------
    c = src.config
    outputs, why = engines.captured_layer_outputs(view, c.target_num_layers, c.target_architecture)
    if why:
        problems.append(why)
    elif len(set(c.aux_layer_ids)) < len(c.aux_layer_ids):
        problems.append(
            f"the draft was trained on aux layers {c.aux_layer_ids}, which repeat a layer: the engine "
            f"captures each layer once, so fc would get {len(set(c.aux_layer_ids))} states of the "
            f"{len(c.aux_layer_ids)} it expects (train again with distinct --aux-layers; `spec eval "
            "--engine torch` runs this draft)"
        )
    elif outputs != sorted(c.aux_layer_ids):
        problems.append(
            f"the engine would feed the draft the outputs of layers {outputs} "
            f"(ids {view.aux_ids}); it was trained on {sorted(c.aux_layer_ids)}"
        )

    if problems or targets is None:
        return problems, None

    # -- predictions -----------------------------------------------------------------------------
    state = reader.draft_state(loaded)
    # the engine embeds with the draft's table when it loaded one, else with the target's (the
    # checkpoint's frozen copy), which it holds in the serving dtype too
    embed = src.state["embed_tokens.weight"].to(dtype).float()
    state.setdefault("embed_tokens.weight", embed)
    state["d2t"] = vocab_map.d2t_from_ids(targets)
    state["t2d"] = vocab_map.t2d_from_ids(targets, V)
    try:
        exported = _materialise(reader.draft_config(view, outputs, c.target_num_layers), state)
    except (ConfigError, RuntimeError, KeyError) as exc:
        return problems + [f"the engine's draft cannot be built from the export ({exc})"], None

    cast = {
        k: (v.to(dtype).float() if v.dtype in _FLOATS else v)
        for k, v in src.state.items()
        if k != "embed_tokens.weight"
    }
    as_cast = _materialise(c, {**cast, "embed_tokens.weight": embed})  # embed shared, not copied
    as_trained = _materialise(
        c, {k: (v.float() if v.dtype in _FLOATS else v) for k, v in src.state.items()}
    )

    g = torch.Generator().manual_seed(0)
    B, T, steps = 2, 16, 2
    layers = sorted(set(c.aux_layer_ids) | set(outputs))
    states = {layer: torch.randn(B, T, c.target_hidden_size, generator=g) for layer in layers}
    ids = torch.randint(0, V, (B, T), generator=g)
    aux_trained = torch.cat([states[i] for i in c.aux_layer_ids], dim=-1)  # training order
    aux_engine = torch.cat([states[i] for i in outputs], dim=-1)  # the engine's order
    got = _predict(exported, ids, aux_engine, steps)
    want = _predict(as_cast, ids, aux_trained, steps)
    fp32 = _predict(as_trained, ids, aux_trained, steps)

    found, confident, agreement = compare_predictions(got, want, fp32, dtype, "draft step {}")
    problems += found
    report = CheckReport(
        format=fmt,
        params_loaded=len(loaded),
        aux_layer_outputs=outputs,
        positions=B * T * steps,
        confident=confident,
        agreement_fp32=agreement,
    )
    return problems, report


# ----------------------------------------------------------------------------- pieces


def _config_problems(view: engines.EngineView, c: DraftConfig) -> list[str]:
    """The draft the engine builds vs the one that was trained."""
    if view.hidden_size == 0:
        return []
    trained_scaling = engines.rope_scaling_of(c.rope_scaling)
    fields = [
        ("vocab_size", view.vocab_size, c.vocab_size),
        ("draft_vocab_size", view.draft_vocab_size, c.draft_vocab_size),
        ("hidden_size", view.hidden_size, c.hidden_size),
        ("target_hidden_size", view.target_hidden_size, c.target_hidden_size),
        ("intermediate_size", view.intermediate_size, c.intermediate_size),
        ("num_attention_heads", view.num_attention_heads, c.num_attention_heads),
        ("num_key_value_heads", view.num_key_value_heads, c.num_key_value_heads),
        ("head_dim", view.head_dim, c.head_dim),
        ("num_hidden_layers", view.num_hidden_layers, c.num_hidden_layers),
        ("rms_norm_eps", view.rms_norm_eps, c.rms_norm_eps),
        ("rope_theta", view.rope_theta, c.rope_theta),
        ("rope_scaling", view.rope_scaling, trained_scaling),
        ("max_position_embeddings", view.max_position_embeddings, c.max_position_embeddings),
        ("hidden_act", view.hidden_act, c.hidden_act),
        ("fc_norm", view.fc_norm, c.fc_norm),
        ("norm_output", view.norm_output, c.norm_output),
        ("sliding_window", view.sliding_window, c.sliding_window),
    ]
    if c.mask_token_id is not None or view.parallel_drafting:  # a parallel-drafting (P-EAGLE) draft
        fields.append(("mask_token_id (parallel drafting)", view.mask_token_id, c.mask_token_id))
    problems = [
        f"{name} is {got} for the engine, {want} in training"
        for name, got, want in fields
        if got != want
    ]
    if view.norm_before_residual:
        problems.append(
            "the engine would apply hidden_norm before taking the residual "
            "(norm_before_residual); the draft was trained without it"
        )
    if view.norm_before_fc:
        problems.append(
            "the engine would RMSNorm the concatenated aux states (norm_before_fc); "
            "the draft was trained without it"
        )
    if not view.use_aux_hidden_state:
        problems.append("eagle_config.use_aux_hidden_state is false: the engine would skip fc")
    return problems


def _checkpoint_selected_ids(src: DraftSource) -> torch.Tensor | None:
    """arange(Vd) + d2t, cross-checked against the checkpoint's t2d mask."""
    selected = src.selected_token_ids
    return selected if torch.equal(selected, vocab_map.ids_from_t2d(src.state["t2d"])) else None


def _materialise(config: DraftConfig, state: dict[str, torch.Tensor]):
    """The algorithm's draft holding `state` (no second copy of the weights: built on the meta device)."""
    with torch.device("meta"):
        draft = algorithms.get(config.algorithm).build(config)
    draft.load_state_dict(state, strict=True, assign=True)
    draft.inv_freq = rope_inv_freq(config)  # non-persistent buffer: rebuild it off the meta device
    draft.attn_impl = "math"
    return draft.eval()


@torch.no_grad()
def _predict(draft, ids: torch.Tensor, aux: torch.Tensor, steps: int):
    """[(logits [B, T, Vd] fp32, predicted target ids [B, T])] for draft steps 0..steps-1. Step k reads
    the ids rolled left by k and the draft's own state of step k-1 (where norm_output matters); a
    parallel-drafting draft's step k >= 1 is its depth-k mask slot after every position instead."""
    B, T = ids.shape
    if hasattr(draft, "parallel_forward"):
        rows, anchors = torch.ones(B, T, dtype=torch.bool).nonzero(as_tuple=True)
        state0, deep = draft.parallel_forward(
            ids, aux, torch.arange(T).expand(B, T), None, [(rows, anchors)] * (steps - 1)
        )
        states = [state0] + [s.view(B, T, -1) for s in deep]
        return [
            (draft.logits(s).float(), draft.to_target_ids(draft.logits(s).float().argmax(-1)))
            for s in states
        ]
    cos, sin = draft.rope(torch.arange(T).expand(B, T))
    caches = [[] for _ in draft.decoder_layers]
    hidden = draft.project(aux)
    out = []
    for k in range(steps):
        hidden = draft.ttt_step(torch.roll(ids, -k, dims=1), hidden, cos, sin, caches)
        logits = draft.logits(hidden).float()
        out.append((logits, draft.to_target_ids(logits.argmax(-1))))
    return out


def _margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit. [B, T]."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
