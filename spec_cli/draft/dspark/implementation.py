"""DSpark's code behind the `DSPARK` declaration (spec_cli/draft/dspark/__init__.py)."""

from __future__ import annotations

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.dflash import implementation as dflash
from spec_cli.draft.dspark import MARKOV_RANK, decoding
from spec_cli.draft.dspark import export as writer
from spec_cli.draft.dspark.model import DSparkDraft
from spec_cli.draft.dspark.objective import DSparkObjective


def config(
    target_config,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    block_size: int | None = None,
    markov_rank: int | None = None,
    confidence_head: bool | None = None,
    confidence_with_markov: bool | None = None,
    **options,
) -> DraftConfig:
    """DFlash's config with the heads' settings (all part of the draft: DraftConfig.extra)."""
    c = dflash.config(target_config, draft_vocab_size, aux_layer_ids, block_size, **options)
    for name, value, default in (
        ("markov_rank", markov_rank, MARKOV_RANK),
        ("confidence_head", confidence_head, True),
        ("confidence_with_markov", confidence_with_markov, True),
    ):
        c.extra[name] = value if value is not None else c.extra.get(name, default)
    c.extra["markov_rank"] = int(c.extra["markov_rank"])
    return c


build = DSparkDraft
objective = DSparkObjective
catch_up = decoding.catch_up
propose = decoding.propose
export = writer.build


def readme_lines(src, files) -> list[str]:
    """The export README's words on serving a DSpark draft (spec_cli/export/readme.py asks)."""
    return [
        "## Block drafting with a Markov head",
        "",
        f"vLLM proposes {files.num_speculative_tokens} draft tokens per forward of this draft "
        '(`"method": "dspark"`): the newest verified token and noise tokens, then the Markov head '
        "(rank {}) samples them left to right.".format(src.config.extra["markov_rank"])
        + (
            " The confidence head is included; vLLM sizes verification by it with "
            '`"enable_adaptive_verification": true`.'
            if src.config.extra["confidence_head"]
            else ""
        )
        + " vLLM 0.32 serves DSpark in its V2 model runner only (a CUDA GPU, or a CPU with triton-cpu).",
        "",
    ]
