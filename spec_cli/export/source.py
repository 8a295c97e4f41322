"""What export reads: one draft checkpoint of a `spec train` run, plus what the run knows about it
(the target it was trained for, the TTT depth, the last held-out evaluation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from spec_cli.artifacts import vocab_map
from spec_cli.artifacts.checkpoint import check_config, load_frozen, resolve_checkpoint, run_dir_of
from spec_cli.draft.config import DraftConfig
from spec_cli.errors import ArtifactError, ConfigError


@dataclass
class DraftSource:
    checkpoint: Path  # the checkpoints/step-* folder
    run_dir: Path | None  # the run folder around it, when there is one
    step: int
    config: DraftConfig  # aux_layer_ids in spec_cli's convention: 0-indexed layer OUTPUTS
    state: dict[
        str, torch.Tensor
    ]  # model.safetensors + the run's frozen weights (Eagle3Draft names)
    target: str | None  # target path or hub id (README, speculators verifier)
    ttt_steps: int | None
    last_eval: dict | None  # the last log.jsonl eval record at or before `step`
    missing_frozen: tuple[
        str, ...
    ] = ()  # frozen keys neither the checkpoint nor its run folder holds

    @property
    def selected_token_ids(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocab: arange(Vd) + d2t."""
        return vocab_map.ids_from_d2t(self.state["d2t"])


def load_source(path: Path, target: str | None = None, frozen_required: bool = True) -> DraftSource:
    """A run folder (RUN/best when the run kept one, else its latest checkpoint) or a checkpoint folder
    (checkpoints/step-*, best) -> DraftSource, with the
    frozen weights (embed_tokens) the checkpoint was saved without read back from the run's
    frozen.safetensors. frozen_required=False: a checkpoint whose run file is gone loads without them
    (listed in `missing_frozen`; eval takes the target's own)."""
    checkpoint = resolve_checkpoint(Path(path))
    try:
        raw_config = json.loads((checkpoint / "config.json").read_text())
        trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
        state = load_file(str(checkpoint / "model.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ArtifactError(
            f"{checkpoint} is not a readable spec_cli draft checkpoint ({exc})",
            "pass a run folder written by `spec train` or one of its checkpoints/step-* "
            "folders (not an export folder)",
        ) from exc
    check_config(checkpoint, raw_config)
    try:
        config = DraftConfig.from_dict(raw_config)
    except (TypeError, ConfigError) as exc:
        raise ArtifactError(
            f"{checkpoint}/config.json is not a draft config ({exc})",
            "pass a checkpoint written by `spec train`",
        ) from exc
    frozen = load_frozen(checkpoint, required=frozen_required)
    state.update(frozen)
    missing = _check_state(checkpoint, config, state, optional=() if frozen_required else _FROZEN)

    run_dir = run_dir_of(checkpoint)
    run = _read_json(run_dir / "run.json") if run_dir else {}
    options = run.get("options", {})
    step = int(trainer_state.get("step", 0))
    return DraftSource(
        checkpoint=checkpoint,
        run_dir=run_dir,
        step=step,
        config=config,
        state=state,
        target=target or _run_target(options),
        ttt_steps=options.get("ttt_steps"),
        last_eval=_last_eval(run_dir, step) if run_dir else None,
        missing_frozen=missing,
    )


_FROZEN = (
    "embed_tokens.weight",
    "lm_head.weight",
)  # what drafts may copy from the target (EAGLE-1/2: both)


def _check_state(
    checkpoint: Path,
    config: DraftConfig,
    state: dict[str, torch.Tensor],
    optional: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """The checkpoint's tensors are those of its algorithm's draft with this config, with a valid vocab
    map where the draft has one (d2t/t2d); -> the `optional` keys it lacks."""
    from spec_cli.draft import algorithms

    with torch.device("meta"):
        expected = {
            k: tuple(v.shape)
            for k, v in algorithms.get(config.algorithm).build(config).state_dict().items()
        }
    absent = tuple(k for k in optional if k in expected and k not in state)
    missing = sorted(set(expected) - set(state) - set(absent))
    unknown = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if missing or unknown or wrong:
        raise ArtifactError(
            f"{checkpoint}/model.safetensors does not match its config.json "
            f"(missing {missing[:3]}, unknown {unknown[:3]}, wrong shape {wrong[:3]})",
            "the checkpoint is corrupt; export another checkpoint of the run",
        )
    if "d2t" not in expected:  # the draft's vocabulary is the target's (EAGLE-1/2)
        return absent
    selected = vocab_map.ids_from_d2t(state["d2t"])
    ok = vocab_map.valid_ids(selected, config.vocab_size) and torch.equal(
        state["t2d"].bool(), vocab_map.t2d_from_ids(selected, config.vocab_size)
    )
    if not ok:
        raise ArtifactError(
            f"{checkpoint} holds no valid vocab map (d2t/t2d are not the offsets and "
            "mask of ascending target ids)",
            "the draft was saved before its vocab map was set; retrain it",
        )
    return absent


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _run_target(options: dict) -> str | None:
    """The target the run trained against: --target, or the one its feature cache was made from."""
    if options.get("target"):
        return str(options["target"])
    if options.get("cache"):
        return _read_json(Path(options["cache"]) / "manifest.json").get("target")
    return None


def _last_eval(run_dir: Path, step: int) -> dict | None:
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
        return None
    evals = [
        r for r in records if r.get("split") == "eval" and r.get("step", 0) <= step and r.get("acc")
    ]
    return evals[-1] if evals else None
