"""DFlash's code behind the `DFLASH` declaration (spec_cli/draft/dflash/__init__.py)."""

from __future__ import annotations

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.dflash import decoding
from spec_cli.draft.dflash import export as writer
from spec_cli.draft.dflash.model import DFlashDraft
from spec_cli.draft.dflash.objective import DFlashObjective
from spec_cli.draft.peagle.implementation import mask_token_id

DEFAULT_BLOCK_SIZE = 8


def config(
    target_config,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    block_size: int | None = None,
    **options,
) -> DraftConfig:
    """The draft's config; the block size (`--block-size`) is part of it (DraftConfig.extra)."""
    options.setdefault("mask_token_id", mask_token_id(target_config))
    extra = dict(options.pop("extra", None) or {})
    extra["block_size"] = int(block_size or extra.get("block_size") or DEFAULT_BLOCK_SIZE)
    return DraftConfig.from_target(
        target_config, draft_vocab_size, aux_layer_ids, extra=extra, **options
    )


build = DFlashDraft
objective = DFlashObjective
catch_up = decoding.catch_up
propose = decoding.propose
export = writer.build


def readme_lines(src, files) -> list[str]:
    """The export README's words on serving a DFlash draft (spec_cli/export/readme.py asks)."""
    return [
        "## Block drafting",
        "",
        f"vLLM proposes {files.num_speculative_tokens} draft tokens in one forward of this draft "
        f'(`"method": "dflash"`): the newest verified token and {files.num_speculative_tokens} copies '
        f"of the mask token {src.config.mask_token_id}, attending to each other without a causal mask and "
        "to keys and values made from the target's hidden states. SGLang has no DFlash drafter in the "
        "versions spec_cli checks against, so no SGLang format is written.",
        "",
    ]
