"""P-EAGLE's code behind the `PEAGLE` declaration (spec_cli/draft/peagle/__init__.py)."""

from __future__ import annotations

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.peagle import decoding
from spec_cli.draft.peagle import export as writer
from spec_cli.draft.peagle.model import PEagleDraft
from spec_cli.draft.peagle.objective import PEagleObjective


def mask_token_id(target_config) -> int:
    """The mask slots' token: the target's pad token, else its (first) eos token, else its last id.
    Its embedding is the target's (frozen); what the draft learns for the mask slots is mask_hidden."""
    text = getattr(target_config, "text_config", None) or target_config
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(text, name, None)
        if value is None:
            value = getattr(target_config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None and 0 <= int(value) < text.vocab_size:
            return int(value)
    return int(text.vocab_size) - 1


def config(
    target_config, draft_vocab_size: int, aux_layer_ids: list[int], **options
) -> DraftConfig:
    options.setdefault("mask_token_id", mask_token_id(target_config))
    return DraftConfig.from_target(target_config, draft_vocab_size, aux_layer_ids, **options)


build = PEagleDraft
objective = PEagleObjective
catch_up = decoding.catch_up
propose = decoding.propose
export = writer.build


def readme_lines(src, files) -> list[str]:
    """The export README's words on serving a P-EAGLE draft (spec_cli/export/readme.py asks)."""
    return [
        "## Parallel drafting",
        "",
        f"vLLM proposes all {files.num_speculative_tokens} draft tokens in one forward of this draft "
        '(`"parallel_drafting": true` in the speculative config above), the target\'s token '
        f"{src.config.mask_token_id} standing in for the ones not yet drafted. SGLang has no parallel "
        "drafting, so no SGLang format is written.",
        "",
    ]
