"""MSD, multimodal speculative decoding (docs/msd.md): a draft for vision-language targets that holds no
token embeddings of its own. At each slot it reads what the target's first decoder layer reads at the next
token (the token's embedding as the target scales it; at an image placeholder, the image's projected
features) together with the target's last hidden state, regresses the target's next hidden state and
proposes through the target's frozen language head: EAGLE-1/2's objective on image-aware inputs.

Training follows a curriculum (curriculum.py): text batches only for --text-steps optimizer steps, then
the share of image-text batches rises linearly to --multimodal-ratio over --multimodal-ramp-steps; each
step's source is drawn from the global step alone, so a resumed run and every torchrun rank make the
same choices. No serving engine runs MSD drafts (REASON): `spec eval` decodes them, chain or tree.
Everything spec_cli needs of it is the `MSD` value below (its code: implementation.py)."""

from __future__ import annotations

from dataclasses import dataclass

from spec_cli.draft.algorithm import FINAL_HIDDEN, INPUT_EMBEDS, LM_HEAD, Algorithm
from spec_cli.draft.eagle import no_aux_layers
from spec_cli.help import OBJECTIVE
from spec_cli.options import FRACTION, option

# Why `spec export` writes nothing for it (read in vLLM 0.32's sources; SGLang's SpeculativeAlgorithm enum
# has EAGLE, EAGLE3, STANDALONE and NGRAM, NEXTN taken as EAGLE)
REASON = (
    "no serving engine runs MSD drafts: vLLM 0.32's speculative methods (SpeculativeMethod in "
    "vllm/config/speculative.py) have none, and its EAGLE drafts embed an image's placeholder tokens "
    "with their own table (llama_eagle3.py's embed_input_ids ignores the target's image features), so "
    "an MSD draft served as EAGLE would not read what it was trained on; SGLang has no MSD either"
)


@dataclass(frozen=True)
class MsdOptions:
    """`spec train --algorithm msd`'s own options (its objective also reads --feature-weight and
    --token-weight, EAGLE-1/2's)."""

    text_steps: int = option(
        0,
        "--text-steps",
        help="--algorithm msd: optimizer steps on text batches only, before image-text "
        "batches enter.",
        panel=OBJECTIVE,
        min=0,
    )
    multimodal_ratio: float = option(
        0.5,
        "--multimodal-ratio",
        help="--algorithm msd: the share of optimizer steps on image-text batches "
        "once the ramp is done.",
        panel=OBJECTIVE,
        allowed=FRACTION,
    )
    multimodal_ramp_steps: int = option(
        0,
        "--multimodal-ramp-steps",
        help="--algorithm msd: optimizer steps over which the image-text share "
        "rises linearly to --multimodal-ratio after --text-steps (step k of "
        "the ramp: ratio x k / this; 0: the whole ratio at once).",
        panel=OBJECTIVE,
        min=0,
    )


MSD = Algorithm(
    name="msd",
    # EAGLE-3's defaults (TTT 3, lr 1e-3) are measured for EAGLE-3 only (docs/recipe.md)
    option_defaults=(("ttt_steps", 7), ("lr", 2e-4)),
    title="MSD",
    summary="vision-language targets: reads the target's image-aware input embeddings",
    aux_layers=0,
    default_aux_layers=no_aux_layers,
    implementation="spec_cli.draft.msd.implementation",
    options=MsdOptions,
    needs=frozenset({FINAL_HIDDEN, LM_HEAD, INPUT_EMBEDS}),
    own_embeddings=False,
    curriculum=True,
    not_served=REASON,
    context_parallel=True,  # --context-parallel (spec_cli/draft/context.py), as EAGLE-1/2
)
