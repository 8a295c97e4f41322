"""`spec train`: train a draft of any registered --algorithm (EAGLE-3 by default).

Supervision comes from a feature cache (`--cache`), a live target (`--target`) or served targets
(`--remote`), all through the TargetBackend interface. The batch plan is fixed up front and the data
position is a function of the step alone, so `--resume` continues exactly where a run stopped. The
trainer itself is the package spec_cli/trainer/ (docs/architecture.md, "The train stage").
"""

from __future__ import annotations

from spec_cli.train_options import TrainConfig, typed_options
from spec_cli.trainer.run import TrainResult, train


def run(cfg: TrainConfig, after_step=None, given: set[str] | None = None) -> TrainResult:
    """Train as `cfg` says; `after_step(step)` is called after each optimizer step (tests use it).

    `given`: the options the user gave (command line or --config); with --resume the others come from
    the run's run.json. None: from the `spec train` command being run, if any (else every option counts
    as given, as the config says)."""
    return train(cfg, typed_options() if given is None else given, _eval_depth, after_step)


def _eval_depth(draft_config) -> int:
    """The chain `spec eval` decodes a draft of this config with: the engine in the loop's depth
    when --eval-engine-depth is not given (the eval stage is loaded only then)."""
    from spec_cli.stages import eval as evaluation

    return evaluation.natural_depth(draft_config)
