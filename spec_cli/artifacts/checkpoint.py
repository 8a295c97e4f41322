"""Training run folders and draft checkpoints (safetensors + JSON, written atomically).

    RUN_DIR/
      run.json                      the training options and the inputs' fingerprints
      log.jsonl                     one JSON object per logged train/eval step
      training.png                  loss and per-step accuracy over training (at the end)
      frozen.safetensors            the frozen weights copied from the target (embed_tokens.weight), once
      checkpoints/step-00000100/
        model.safetensors           trained weights + d2t/t2d buffers (serving engines' key names); the
                                    frozen ones are in ../../frozen.safetensors, named by fingerprint
        optimizer.safetensors       AdamW state, flattened: state.<param name>.<exp_avg|exp_avg_sq|step>;
                                    under FSDP2 one optimizer-RRRRR-of-WWWWW.safetensors per rank instead
                                    (its rows of each tensor; trainer_state.json: optimizer_shards W)
        rng.safetensors             torch RNG states
        config.json                 DraftConfig
        trainer_state.json          step, epoch, data position, schedule, param groups, metrics

A checkpoint folder is built beside its final name and renamed into place, so one that exists is
complete; a run killed mid-save keeps its previous checkpoints. The frozen table never changes during a
run (Gemma 3's is 262k x 640), so it is written once per run instead of into every checkpoint; a reader
finds it beside the checkpoint or in the run folder and checks its fingerprint. Checkpoints written
before that hold it in model.safetensors and still load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from spec_cli.artifacts import io
from spec_cli.artifacts.io import SCHEMA_VERSION, atomic_dir, write_safetensors
from spec_cli.errors import ArtifactError, listing

CHECKPOINTS = "checkpoints"
FROZEN = "frozen.safetensors"
BEST = (
    "best"  # RUN/best: the checkpoint that accepted best in the engine (`spec train --keep best`)
)
BEST_JSON = "best.json"  # inside it: the step and what the engine measured
ENGINE_EVAL = (
    "engine-eval"  # RUN/engine-eval/step-N/{checkpoint,eval.json,...}: the in-loop evaluations
)
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
    """A checkpoint folder from a run folder (RUN/best when the run kept one, else its latest) or a
    checkpoint folder; one whose files are damaged is refused, naming the run's newest intact one."""
    path = Path(path)
    chosen = (
        path
        if (path / "model.safetensors").is_file()
        else best_checkpoint(path) or latest_checkpoint(path)
    )
    if chosen is None:
        raise ArtifactError(
            f"{path} holds no draft checkpoint",
            "pass a run folder written by `spec train` or one of its checkpoints/step-* folders",
        )
    _refuse_damaged(path, chosen)
    return chosen


def best_checkpoint(run_dir: Path) -> Path | None:
    """RUN/best when `spec train --keep best` kept one (complete: its record and weights), else None."""
    best = Path(run_dir) / BEST
    return best if (best / BEST_JSON).is_file() and (best / "model.safetensors").is_file() else None


def best_record(run_dir: Path) -> dict | None:
    """RUN/best/best.json: the step the best checkpoint was saved at and what the engine measured."""
    best = best_checkpoint(run_dir)
    if best is None:
        return None
    try:
        return json.loads((best / BEST_JSON).read_text())
    except (OSError, ValueError):
        return None


def choice_note(path: Path) -> str | None:
    """What a command that was given a run folder says when it takes RUN/best instead of the latest
    checkpoint (None when it does not)."""
    record = best_record(path) if not (Path(path) / "model.safetensors").is_file() else None
    if record is None:
        return None
    latest = latest_checkpoint(path)
    last = (
        f"; the last checkpoint is step {int(latest.name.split('-')[1])} ({latest})"
        if latest is not None
        else ""
    )
    return (
        f"{path} kept its best checkpoint: taking {Path(path) / BEST} (step {record['step']}, acceptance "
        f"length {record['acceptance_length']:.3f} in {record['engine']}, the best of the steps the engine "
        f"measured){last}"
    )


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint belongs to: RUN for RUN/checkpoints/step-N, RUN/best and the in-loop
    evaluations' RUN/engine-eval/step-N/checkpoint; None for a checkpoint outside a run."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == CHECKPOINTS:
        return checkpoint.parent.parent
    if checkpoint.name == BEST and (checkpoint.parent / "run.json").is_file():
        return checkpoint.parent
    if checkpoint.parent.parent.name == ENGINE_EVAL:
        return checkpoint.parent.parent.parent
    return None


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


# ----------------------------------------------------------------------------- frozen weights


def frozen_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 (16 hex) of names, shapes and fp32 values: the same for a bf16 table and its fp32 copy."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu()
        digest.update(f"{name}:{list(t.shape)};".encode())
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), 1 << 24):  # 64 MB of fp32 at a time
            digest.update(flat[start : start + (1 << 24)].float().numpy().tobytes())
    return digest.hexdigest()[:16]


def save_frozen(
    run_dir: Path, tensors: dict[str, torch.Tensor], fingerprint: str, about: dict
) -> Path:
    """RUN_DIR/frozen.safetensors, once per run: the frozen target weights as the target holds them
    (the draft's fp32 copy is an exact upcast). A file with this fingerprint is left as it is."""
    path = Path(run_dir) / FROZEN
    if frozen_meta(path).get("fingerprint") != fingerprint:
        write_safetensors(
            path,
            tensors,
            {
                "kind": "frozen_weights",
                "schema_version": SCHEMA_VERSION,
                "fingerprint": fingerprint,
                "keys": sorted(tensors),
                **about,
            },
        )
    return path


def frozen_meta(path: Path) -> dict:
    """The spec_cli metadata of a frozen-weights file ({} when there is none or it is unreadable)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("spec_cli", "{}"))
    except (OSError, ValueError, SafetensorError):
        return {}


def checkpoint_meta(path: Path) -> dict:
    """The spec_cli metadata of a checkpoint's model.safetensors."""
    try:
        with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("spec_cli", "{}"))
    except (OSError, ValueError, SafetensorError):
        return {}


def frozen_candidates(checkpoint: Path) -> list[Path]:
    """Where a checkpoint's frozen weights may be: beside it, then in its run folder."""
    checkpoint = Path(checkpoint)
    found = [checkpoint / FROZEN]
    run_dir = run_dir_of(checkpoint)
    if run_dir is not None:
        found.append(run_dir / FROZEN)
    return found


def load_frozen(checkpoint: Path, required: bool = True) -> dict[str, torch.Tensor]:
    """The frozen weights a checkpoint was saved without ({} for a checkpoint that holds them itself).
    With required=False a missing file gives {} (the caller takes them from the target instead)."""
    record = checkpoint_meta(checkpoint).get("frozen")
    if not record:
        return {}
    want = record["fingerprint"]
    seen = []
    for path in frozen_candidates(checkpoint):
        if not path.is_file():
            continue
        meta = frozen_meta(path)
        if meta.get("fingerprint") != want:
            seen.append(f"{path} (fingerprint {meta.get('fingerprint')})")
            continue
        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise ArtifactError(
                f"cannot read {path}: {exc}", "the run folder is damaged; train again"
            ) from exc
        missing = sorted(set(record["keys"]) - set(tensors))
        if missing:
            raise ArtifactError(f"{path} lacks {missing}", "the run folder is damaged; train again")
        return {k: tensors[k] for k in record["keys"]}
    if seen:
        raise ArtifactError(
            f"the frozen weights of {checkpoint} (fingerprint {want}) are not in "
            + ", ".join(seen),
            "use the checkpoint inside the run folder it was trained in",
        )
    if not required:
        return {}
    places = " or ".join(str(p) for p in frozen_candidates(checkpoint))
    raise ArtifactError(
        f"{checkpoint} is saved without its frozen {', '.join(record['keys'])} (once per run, "
        f"in {FROZEN}), and {places} does not exist",
        f"pass the checkpoint inside its run folder, or copy the run's {FROZEN} into "
        "the checkpoint folder",
    )


# ----------------------------------------------------------------------------- checkpoints


def remove_temporaries(run_dir: Path) -> list[str]:
    """Remove what a killed run left half-written in its folder (run.json, frozen weights, logs) and in
    its checkpoints/ (a checkpoint folder being written or being replaced); call it only while holding
    the run folder's lock. The names removed."""
    return io.remove_temporaries(run_dir) + io.remove_temporaries(
        Path(run_dir) / CHECKPOINTS, r"step-\d{8}"
    )


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where the ranks of a sharded save write the checkpoint of `step` before rank 0 renames it into
    place (a name `remove_temporaries` clears when a run was killed mid-save)."""
    return Path(run_dir) / CHECKPOINTS / f".step-{step:08d}.shards.tmp"


def begin_sharded_save(run_dir: Path, step: int) -> Path:
    """Rank 0, before the ranks write their shards: an empty staging folder."""
    staging = staging_dir(run_dir, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def write_optimizer_shard(
    staging: Path, rank: int, world: int, tensors: dict[str, torch.Tensor], layout: dict
) -> Path:
    """One rank's optimizer state (sharding.local_optimizer_state) as optimizer-RRRRR-of-WWWWW.safetensors,
    with each tensor's global shape and first row in its metadata."""
    path = Path(staging) / optimizer_shard_name(rank, world)
    with _resumable(Path(staging).parent.parent):
        write_safetensors(
            path,
            tensors,
            {"kind": "optimizer_shard", "rank": rank, "world": world, "layout": layout},
        )
    return path


def optimizer_shard_name(rank: int, world: int) -> str:
    return f"optimizer-{rank:05d}-of-{world:05d}.safetensors"


def optimizer_shards(checkpoint: Path) -> int | None:
    """The number of ranks whose optimizer shards a checkpoint holds (None: one optimizer.safetensors)."""
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text()).get("optimizer_shards")


def read_optimizer(checkpoint: Path, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's optimizer state, flat: the whole of it (shards put together row by row), or
    with `rank` that rank's own shard file as written."""
    checkpoint = Path(checkpoint)
    world = optimizer_shards(checkpoint)
    if world is None:
        return load_file(str(checkpoint / "optimizer.safetensors"))
    if rank is not None:
        return load_file(str(checkpoint / optimizer_shard_name(rank, world)))
    parts: dict[str, list] = {}
    shapes: dict[str, list] = {}
    for r in range(world):
        path = checkpoint / optimizer_shard_name(r, world)
        with safe_open(str(path), framework="pt") as f:
            layout = json.loads((f.metadata() or {})["spec_cli"])["layout"]
            for key in f.keys():
                shape, start = layout[key]
                shapes[key] = shape
                if start is None:
                    parts[key] = [(0, f.get_tensor(key))]  # the same on every rank
                else:
                    parts.setdefault(key, []).append((start, f.get_tensor(key)))
    out = {}
    for key, pieces in parts.items():
        value = (
            torch.cat([t for _, t in sorted(pieces, key=lambda x: x[0])])
            if len(pieces) > 1
            else pieces[0][1]
        )
        if list(value.shape) != shapes[key]:
            raise ArtifactError(
                f"the optimizer shards of {checkpoint} do not add up to {key}'s shape {shapes[key]}",
                "the checkpoint is damaged: resume from the one before it",
            )
        out[key] = value
    return out


def save_checkpoint(
    run_dir: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_tensors: dict[str, torch.Tensor] | None,
    rng: dict[str, torch.Tensor],
    draft_config: dict,
    trainer_state: dict,
    keep_last: int | None = None,
    frozen: dict | None = None,
    staged: Path | None = None,
    shards: int | None = None,
) -> Path:
    """`frozen`: {"keys": [...], "fingerprint": ...} of the weights model_state leaves out (in the
    run's frozen.safetensors, written by save_frozen). `staged`: the folder of a sharded save, holding
    the ranks' `shards` optimizer files already (optimizer_tensors None); it becomes the checkpoint."""
    final = Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"
    if shards is not None:
        trainer_state = {**trainer_state, "optimizer_shards": shards}
    with (
        _resumable(run_dir),
        atomic_dir(final) if staged is None else io.atomic_dir_from(staged, final) as tmp,
    ):
        _write_weights(tmp, step, model_state, draft_config, trainer_state, frozen)
        if optimizer_tensors is not None:
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in optimizer_tensors.items()},
                str(tmp / "optimizer.safetensors"),
            )
        elif shards is None or sorted(p.name for p in tmp.glob("optimizer-*")) != [
            optimizer_shard_name(r, shards) for r in range(shards)
        ]:
            raise RuntimeError(
                f"a sharded checkpoint needs the {shards} ranks' optimizer files in {tmp}"
            )
        save_file({k: v.contiguous().cpu() for k, v in rng.items()}, str(tmp / "rng.safetensors"))
    if keep_last:
        for old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_weights(
    folder: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    draft_config: dict,
    trainer_state: dict,
    frozen: dict | None = None,
) -> Path:
    """A checkpoint of the weights alone (model.safetensors, config.json, trainer_state.json; no optimizer
    or RNG state: export and eval read it, a resume does not), written atomically into `folder`."""
    with _resumable(run_dir_of(folder)), atomic_dir(Path(folder)) as tmp:
        _write_weights(
            tmp, step, model_state, draft_config, {**trainer_state, "weights_only": True}, frozen
        )
    return Path(folder)


@contextlib.contextmanager
def _resumable(run_dir: Path | None):
    """A disk that fills while `spec train` writes into its run folder: the hint gives the command that
    continues the run from its last checkpoint (a plain rerun is refused: the folder holds checkpoints)."""
    try:
        yield
    except io.DiskFullError as exc:
        latest = latest_checkpoint(run_dir) if run_dir is not None else None
        if latest is None:  # nothing to continue from: the same command starts the run again
            raise
        raise io.DiskFullError(
            exc.message,
            f"free space there, then continue from {latest.name} with `spec train "
            f"--resume -o {run_dir}` (or move the run folder to a disk with room and pass that "
            "as -o); nothing half-written was kept",
        ) from exc


def _write_weights(
    folder: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    draft_config: dict,
    trainer_state: dict,
    frozen: dict | None,
) -> None:
    """model.safetensors (its spec_cli record: step, config digest, the frozen weights it leaves out),
    config.json and trainer_state.json into `folder`."""
    record = {
        "kind": "draft_checkpoint",
        "schema_version": SCHEMA_VERSION,
        "step": step,
        "config_sha256": config_digest(draft_config),
    }  # config.json edited later is caught on read
    if frozen:
        overlap = sorted(set(frozen["keys"]) & set(model_state))
        if overlap:
            raise ValueError(f"frozen weights {overlap} are also in model_state")
        record["frozen"] = {
            "keys": sorted(frozen["keys"]),
            "fingerprint": frozen["fingerprint"],
            "file": FROZEN,
        }
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in model_state.items()},
        str(folder / "model.safetensors"),
        metadata={"spec_cli": json.dumps(record)},
    )
    (folder / "config.json").write_text(json.dumps(draft_config, indent=2, sort_keys=True) + "\n")
    (folder / "trainer_state.json").write_text(
        json.dumps({"schema_version": SCHEMA_VERSION, **trainer_state}, indent=2, sort_keys=True)
        + "\n"
    )


def config_digest(config: dict) -> str:
    """The sha256 of a draft config's content (key order and spacing do not count)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def check_config(checkpoint: Path, config: dict) -> None:
    """Refuse a config.json changed after its checkpoint was saved (aux layers, sizes, vocab): the
    weights were trained for the recorded one, and an edited one would export a draft that serves badly.
    Checkpoints written before the digest was recorded pass."""
    want = checkpoint_meta(checkpoint).get("config_sha256")
    if want and want != config_digest(config):
        raise ArtifactError(
            f"{Path(checkpoint) / 'config.json'} was changed after the checkpoint was saved "
            "(its content no longer matches the digest recorded in model.safetensors)",
            "restore the file as `spec train` wrote it; options such as the aux layers "
            "are part of what the draft learned and cannot be edited afterwards",
        )


def load_checkpoint(path: Path, resume: bool = False, optimizer_rank: int | None = None) -> dict:
    """model / optimizer / rng tensors, config and trainer_state of one checkpoint folder; "model" lacks
    the "frozen_keys" (the trainer copies them from the target again, export reads load_frozen).
    `resume`: the optimizer and RNG states are required too (a checkpoint without them exports but
    cannot continue bit for bit). A sharded checkpoint's optimizer comes whole (its ranks' files put
    together), or with `optimizer_rank` as that rank's own file."""
    path = Path(path)
    if resume:
        files = ["rng.safetensors"]
        try:
            world = optimizer_shards(path)
        except (OSError, ValueError):
            world = None  # (the read below names the problem)
        files += (
            ["optimizer.safetensors"]
            if world is None
            else [optimizer_shard_name(r, world) for r in range(world)]
        )
        missing = [name for name in files if not (path / name).is_file()]
        if missing:
            raise ArtifactError(
                f"the checkpoint {path} lacks {' and '.join(missing)}, so training cannot "
                "resume from it",
                "restore the file, or move that checkpoint folder out of "
                "checkpoints/ to resume from the one before it (export still reads it)",
            )
    try:
        parts = {
            "model": load_file(str(path / "model.safetensors")),
            "frozen_keys": (checkpoint_meta(path).get("frozen") or {}).get(
                "keys", []
            ),  # not in "model"
            "config": json.loads((path / "config.json").read_text()),
            "trainer_state": json.loads((path / "trainer_state.json").read_text()),
        }
        sharded = parts["trainer_state"].get("optimizer_shards") is not None
        if sharded or (path / "optimizer.safetensors").is_file():
            if optimizer_rank is None or not sharded:
                parts["optimizer"] = read_optimizer(path)
            else:  # one rank of a sharded resume: its own file only
                parts["optimizer"] = read_optimizer(path, optimizer_rank)
            parts["rng"] = load_file(str(path / "rng.safetensors"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"cannot read the checkpoint in {path}: {exc}",
            "pass a complete checkpoint written by `spec train`",
        ) from exc
    check_config(path, parts["config"])
    return parts


# ----------------------------------------------------------------------------- damaged checkpoints
# A checkpoint folder that exists was complete when it was renamed into place; a file in it can still
# be cut short later (an interrupted copy or sync, a failing disk). Readers check the files they need
# before trusting the newest checkpoint, and name the newest intact one instead.

DAMAGED = (
    ".damaged"  # checkpoints/step-N.damaged: a damaged checkpoint `spec train --resume` set aside
)
_HEADER_MAX = 100_000_000  # the largest header safetensors reads


def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file that exists, or None when its header reads and the file is
    as long as the header says. Reads the header only (8 bytes of length, then the JSON)."""
    name = Path(path).name
    try:
        size = Path(path).stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little")
            if len(head) < 8:
                return f"{name} is cut short ({size} bytes, less than a header)"
            if length > _HEADER_MAX:
                return f"{name} has no readable safetensors header (it gives a header of {length:,} bytes)"
            if 8 + length > size:
                return (
                    f"{name} is cut short ({size:,} bytes; its header alone takes {8 + length:,})"
                )
            header = json.loads(f.read(length))
        end = (
            8
            + length
            + max(
                (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
            )
        )
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        return f"{name} has no readable safetensors header ({exc})"
    if size != end:
        return (
            f"{name} is cut short ({size:,} of {end:,} bytes)"
            if size < end
            else f"{name} is longer than its header says ({size:,} bytes, {end:,} expected)"
        )
    try:
        with safe_open(str(path), framework="pt"):
            return None
    except (OSError, SafetensorError) as exc:
        return f"{name} does not read ({exc})"


def checkpoint_damage(checkpoint: Path, resume: bool = False) -> str | None:
    """What is wrong with the files a checkpoint holds (None: all of them read): a safetensors file cut
    short or unreadable, a JSON file that does not parse. Export and eval read model.safetensors,
    config.json and trainer_state.json; `resume` adds the optimizer and RNG files. A missing file is not
    damage: the reader that needs it names it."""
    checkpoint = Path(checkpoint)
    problems = []
    for name in ("config.json", "trainer_state.json"):
        try:
            json.loads((checkpoint / name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{name} does not parse ({exc})")
    names = ["model.safetensors"]
    if resume:
        names += sorted(p.name for p in checkpoint.glob("optimizer*.safetensors")) + [
            "rng.safetensors"
        ]
    for name in names:
        if (checkpoint / name).is_file():
            problems.append(safetensors_damage(checkpoint / name))
    return "; ".join(p for p in problems if p) or None


def newest_intact(run_dir: Path, but: Path | None = None) -> Path | None:
    """The newest checkpoint of a run (other than `but`) whose weights, config and state read, or None."""
    for checkpoint in reversed(checkpoint_dirs(run_dir)):
        if checkpoint != but and checkpoint_damage(checkpoint) is None:
            return checkpoint
    return None


def _refuse_damaged(given: Path, chosen: Path) -> None:
    """The checkpoint export and eval chose for `given` (a run or checkpoint folder) reads, or an error
    naming what is wrong and the run's newest intact checkpoint to pass instead."""
    damage = checkpoint_damage(chosen)
    if damage is None:
        return
    run_dir = run_dir_of(chosen)
    intact = newest_intact(run_dir, but=chosen) if run_dir is not None else None
    if intact is None:
        raise ArtifactError(
            f"the checkpoint {chosen} is damaged: {damage}",
            "restore the file from a copy, or train again (no other checkpoint of the run is intact)",
        )
    again = (
        f" (`spec train --resume -o {run_dir}` sets the damaged one aside and trains again from there)"
        if chosen.parent.name == CHECKPOINTS
        else ""
    )
    raise ArtifactError(
        f"the checkpoint {chosen} is damaged: {damage}",
        f"pass the newest intact checkpoint of the run, {intact}, instead of {given}{again}",
    )


def set_aside_damaged(run_dir: Path) -> str | None:
    """Before `spec train --resume`: move the checkpoints newer than the newest intact one (files cut
    short or unreadable) aside to checkpoints/step-N.damaged, kept for a look and out of the way of the
    run's next saves, so the resume continues from the intact one. The line that says so (None when the
    newest is intact). Refuses when no checkpoint is intact. Call it only while holding the run's lock."""
    dirs = checkpoint_dirs(run_dir)
    damaged = []
    for checkpoint in reversed(dirs):
        damage = checkpoint_damage(checkpoint, resume=True)
        if damage is None:
            break
        damaged.append((checkpoint, damage))
    if not damaged:
        return None
    if len(damaged) == len(dirs):
        raise ArtifactError(
            f"every checkpoint of {run_dir} is damaged: "
            + listing([f"{c.name}: {d}" for c, d in damaged]),
            "restore the files from a copy, or start a new run folder (-o)",
        )
    moved = []
    for checkpoint, damage in damaged:
        aside = _aside_name(checkpoint)
        checkpoint.rename(aside)
        moved.append(
            f"{checkpoint} is damaged: {damage}; moved it aside to {aside.name} (kept, not deleted)"
        )
    return "; ".join(moved) + f"; resuming from {dirs[-1 - len(damaged)]}"


def _aside_name(checkpoint: Path) -> Path:
    """checkpoints/step-N.damaged, or step-N.damaged-K when an earlier one took that name."""
    aside, k = checkpoint.with_name(checkpoint.name + DAMAGED), 1
    while aside.exists():
        k += 1
        aside = checkpoint.with_name(f"{checkpoint.name}{DAMAGED}-{k}")
    return aside
