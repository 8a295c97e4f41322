"""EAGLE-1/2's code behind the `EAGLE` declaration (spec_cli/draft/eagle/__init__.py)."""

from __future__ import annotations

from spec_cli.draft import decoding
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle import export as writer
from spec_cli.draft.eagle.model import EagleDraft
from spec_cli.draft.eagle.objective import EagleObjective

config = DraftConfig.from_target  # the target's shapes (EagleDraft refuses another hidden size)
build = EagleDraft
objective = EagleObjective
catch_up = decoding.catch_up
propose = decoding.propose
export = writer.build
