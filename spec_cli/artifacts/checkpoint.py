"""Training run folders and draft checkpoints (safetensors + JSON, written atomically).

    RUN_DIR/
      run.json                      the training options and the inputs' fingerprints
      log.jsonl                     one JSON object per logged train/eval step
      training.png                  loss and per-step accuracy over training (at the end)
      checkpoints/step-00000100/
        model.safetensors           draft weights + d2t/t2d buffers (engine-style key names)
        optimizer.safetensors       AdamW state, flattened: state.<param name>.<exp_avg|exp_avg_sq|step>
        rng.safetensors             torch RNG states
        config.json                 DraftConfig
        trainer_state.json          step, epoch, data position, schedule, param groups, metrics

A checkpoint folder is built beside its final name and renamed into place, so one that exists is
complete; a run killed mid-save keeps its previous checkpoints.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spec_cli.artifacts.io import SCHEMA_VERSION, atomic_dir
from spec_cli.errors import ArtifactError

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder from a run folder (its latest) or a checkpoint folder."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ArtifactError(f"{path} holds no draft checkpoint",
                            "pass a run folder written by `spec train` or one of its checkpoints/step-* folders")
    return latest


def flatten_optimizer(state_dict: dict, names: list[str]) -> tuple[dict[str, torch.Tensor], list]:
    """torch optimizer state_dict -> (tensors keyed by parameter NAME, param_groups JSON)."""
    tensors = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{names[index]}.{key}"] = value
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]]
    return tensors, groups


def unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list, names: list[str]) -> dict:
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, rest = key.split(".", 1)
        name, field = rest.rsplit(".", 1)
        state.setdefault(index[name], {})[field] = value
    param_groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    return {"state": state, "param_groups": param_groups}


def save_checkpoint(run_dir: Path, step: int, model_state: dict[str, torch.Tensor],
                    optimizer_tensors: dict[str, torch.Tensor], rng: dict[str, torch.Tensor],
                    draft_config: dict, trainer_state: dict, keep_last: int | None = None) -> Path:
    final = Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"
    meta = {"spec_cli": json.dumps({"kind": "draft_checkpoint", "schema_version": SCHEMA_VERSION,
                                    "step": step})}
    with atomic_dir(final) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()},
                  str(tmp / "model.safetensors"), metadata=meta)
        save_file({k: v.detach().contiguous().cpu() for k, v in optimizer_tensors.items()},
                  str(tmp / "optimizer.safetensors"))
        save_file({k: v.contiguous().cpu() for k, v in rng.items()}, str(tmp / "rng.safetensors"))
        (tmp / "config.json").write_text(json.dumps(draft_config, indent=2, sort_keys=True) + "\n")
        (tmp / "trainer_state.json").write_text(
            json.dumps({"schema_version": SCHEMA_VERSION, **trainer_state}, indent=2, sort_keys=True) + "\n")
    if keep_last:
        for old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> dict:
    """model / optimizer / rng tensors, config and trainer_state of one checkpoint folder."""
    path = Path(path)
    try:
        parts = {
            "model": load_file(str(path / "model.safetensors")),
            "config": json.loads((path / "config.json").read_text()),
            "trainer_state": json.loads((path / "trainer_state.json").read_text()),
        }
        if (path / "optimizer.safetensors").is_file():
            parts["optimizer"] = load_file(str(path / "optimizer.safetensors"))
            parts["rng"] = load_file(str(path / "rng.safetensors"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read the checkpoint in {path}: {exc}",
                            "pass a complete checkpoint written by `spec train`") from exc
    return parts
