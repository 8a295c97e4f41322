"""The draft a run trains, built through its algorithm (spec_cli/draft/algorithm.py).

check_algorithm   --algorithm against the supervision (its aux layers) and --context-parallel
algorithm_fields  the per-token fields of the target the algorithm asks the backend for
build_draft       the draft shaped from the target's config (the --draft-* options override), its
                  frozen weights copied from the target (embeddings; EAGLE-1/2's lm_head), its head
                  or first layer started from the target's when asked
"""

from __future__ import annotations

from pathlib import Path

from spec_cli.console import info
from spec_cli.draft import algorithms
from spec_cli.draft.algorithm import FINAL_HIDDEN, LM_HEAD, Algorithm
from spec_cli.errors import ConfigError
from spec_cli.targets import loading
from spec_cli.train_options import TrainConfig
from spec_cli.trainer.sources import Source


def check_algorithm(cfg: TrainConfig, source: Source) -> Algorithm:
    """--algorithm, checked against the aux layers the supervision holds (and --context-parallel)."""
    algorithm = algorithms.get(cfg.draft.algorithm)
    n = cfg.runtime.context_parallel
    if n > 1:
        if not algorithm.context_parallel:
            able = [a.name for a in algorithms.ALGORITHMS.values() if a.context_parallel]
            raise ConfigError(
                f"--context-parallel: {algorithm.title} does not split its rows over ranks yet (its "
                "objective attends across whole blocks of a row)",
                f"drop --context-parallel, or train --algorithm {', '.join(able)}",
            )
    if len(source.aux_layers) != algorithm.aux_layers:
        made = "the feature cache holds" if cfg.data.cache is not None else "the target serves"
        raise ConfigError(
            f"{made} {len(source.aux_layers)} aux layers {source.aux_layers}; {algorithm.name} "
            f"reads {algorithm.aux_layers}",
            f"make the supervision with --algorithm {algorithm.name} (`spec precompute` / "
            "`spec serve-target`), or train the algorithm it was made for",
        )
    return algorithm


def algorithm_fields(algorithm: Algorithm) -> dict:
    """name -> TargetField: what the algorithm asks the backend for in TargetBatch.extras (its needs
    beyond the built-in final hidden state and lm_head)."""
    own = algorithm.target_fields
    missing = sorted(n for n in algorithm.field_needs() if n != FINAL_HIDDEN and n not in own)
    if missing:
        raise ConfigError(
            f"{algorithm.name} needs {', '.join(missing)} of the target but its implementation "
            "defines no such target_fields",
            "declare them in its implementation module",
        )
    return {name: own[name] for name in algorithm.field_needs() if name != FINAL_HIDDEN}


def build_draft(cfg: TrainConfig, algorithm: Algorithm, source: Source, vocab_map):
    """(draft, its config, the frozen weights it copied from the target): shaped from the target's
    config (the --draft-* options override), embeddings from the target, lm_head too with
    --init-from-target."""
    d = cfg.draft
    if d.draft_window is not None:
        if not algorithm.sliding_window:
            raise ConfigError(
                f"--draft-window: {algorithm.title} drafts have no sliding-window attention in "
                "spec_cli (training, decoding and the engines' exports are built for EAGLE-3 only)",
                "drop --draft-window, or train --algorithm eagle3",
            )
        if d.draft_window <= cfg.objective.ttt_steps:
            raise ConfigError(
                f"--draft-window {d.draft_window} does not reach over the {cfg.objective.ttt_steps} "
                "TTT steps: the last step's query would see none of the context",
                f"use --draft-window {cfg.objective.ttt_steps + 1} or more (speculators: 2048)",
            )
    draft_config = algorithm.config(
        loading.config_from_dict(source.target_config),
        vocab_map.draft_vocab_size,
        source.aux_layers,
        num_hidden_layers=d.draft_layers,
        hidden_size=d.draft_hidden_size,
        intermediate_size=d.draft_intermediate_size,
        num_attention_heads=d.draft_heads,
        num_key_value_heads=d.draft_kv_heads,
        fc_norm=d.fc_norm,
        norm_output=d.norm_output,
        rope_theta=d.draft_rope_theta,
        sliding_window=d.draft_window,
        target_fingerprint=source.identity["target_fingerprint"],
        tokenizer_fingerprint=source.identity["tokenizer_fingerprint"],
        chat_template_sha256=source.chat_template.get("chat_template_sha256"),
        chat_template_source=source.chat_template.get("chat_template_source", ""),
        tokenizer_base_fingerprint=source.chat_template.get("tokenizer_base_fingerprint", ""),
        vocab_map_fingerprint=vocab_map.fingerprint,
        algorithm=algorithm.name,
        # the algorithm's options that are part of the draft itself (DFlash: --block-size)
        **{name: getattr(cfg.objective, name) for name in algorithm.draft_options},
    )
    info(f"draft rope: {draft_config.rope_source}")
    draft = algorithm.build(draft_config)
    draft.hidden_noise = (
        cfg.objective.hidden_noise
    )  # not in its config: export and eval never see it
    draft.set_vocab_map(vocab_map.selected_token_ids)
    # The frozen weights (copied from the target, never trained) are stored once per run, as the target
    # holds them (the draft's fp32 copy is an exact upcast); checkpoints leave them out.
    frozen = {}
    if algorithm.own_embeddings:  # (MSD reads the target's input embeddings instead)
        frozen["embed_tokens.weight"] = source.backend.get_input_embeddings()
        rows = frozen["embed_tokens.weight"].shape[0]
        if rows != draft_config.vocab_size:
            raise ConfigError(
                f"the target's input embedding has {rows} rows for its {draft_config.vocab_size}-token "
                "vocabulary (Mllama keeps its image tokens past the vocabulary), and a draft "
                "shares that table with it",
                "spec_cli does not train drafts for such a target yet",
            )
        draft.copy_embeddings(frozen["embed_tokens.weight"])
    if (
        LM_HEAD in algorithm.needs
    ):  # the draft proposes through the target's own lm_head (EAGLE-1/2)
        head = source.backend.get_output_head()
        if head is None:
            raise ConfigError(
                f"this supervision does not give the target's lm_head, which a {algorithm.title} "
                "draft proposes through",
                "train from a feature cache, a live --target or a server",
            )
        draft.copy_head(
            head["lm_head_selected"]
        )  # the whole vocabulary: the vocab map selects every id
        frozen["lm_head.weight"] = head["lm_head_selected"]
    elif d.init_from_target:  # (a --resume then loads its checkpoint over it)
        head = source.backend.get_output_head()
        if head is None or not draft.init_from_target(
            head["lm_head_selected"], head.get("final_norm")
        ):
            info(
                "the draft's lm_head starts random: the target's output head is not available here "
                "or does not fit the draft's hidden size"
            )
    if d.init_layer_from_target:
        _init_layer(draft, draft_config, source, algorithm)
    return draft, draft_config, frozen


def _init_layer(draft, draft_config, source: Source, algorithm: Algorithm) -> None:
    """--init-layer-from-target: the draft's first layer starts as the target's layer after its highest aux
    layer, fc as a pass-through of that aux state (Eagle3Draft.init_layer_from_target)."""
    if not hasattr(draft, "init_layer_from_target"):
        raise ConfigError(
            f"--init-layer-from-target starts an EAGLE-3 draft's layer; a {algorithm.title} draft "
            "has no such layer",
            "leave it out, or pass --algorithm eagle3",
        )
    where = source.target_dir
    if where is None or not Path(where).is_dir():
        raise ConfigError(
            "--init-layer-from-target reads the target's layer from its weights, and "
            + (
                f"the feature cache names a target folder this machine does not have ({where})"
                if where
                else "a served target's weights are not on this machine"
            ),
            "train from a feature cache made on this machine, or with --target MODEL",
        )
    aux = list(draft_config.aux_layer_ids)
    highest = max(range(len(aux)), key=lambda i: aux[i])
    index = min(aux[highest] + 1, draft_config.target_num_layers - 1)
    draft.init_layer_from_target(loading.read_decoder_layer(Path(where), index), highest)
    info(
        f"the draft's layer starts as the target's layer {index} (after aux layer {aux[highest]}), fc as a "
        "pass-through of that layer's state"
    )
