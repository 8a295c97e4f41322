"""What the trainer writes into its run folder and reads back on --resume (the formats:
spec_cli/artifacts/checkpoint.py, docs/artifacts.md).

write_run    run.json (the options, what a --resume must match, the precision chosen here) and the
             frozen weights (copied from the target, never trained), once per run folder
check_room   room on the disk for the next checkpoint, before the first step
save         a checkpoint after a step: the trained weights, the optimizer state (under FSDP2 each
             rank's own rows of it), the RNG state and trainer_state.json
restore      all of that back into the Trainer, checked against the run (the frozen weights, MSD's
             curriculum); the step it was saved at
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from spec_cli import distributed
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts.io import write_json
from spec_cli.console import human_bytes, info
from spec_cli.draft import sharding
from spec_cli.draft.optim import lr_at
from spec_cli.draft.step import optimizer_groups
from spec_cli.errors import ArtifactError
from spec_cli.trainer.device import say_precision


def write_run(trainer, run_json: dict) -> None:
    """run.json and the frozen weights, once per run folder (rank 0); the trainer lets go of its
    copy of the frozen weights (the draft holds them)."""
    output = Path(trainer.cfg.runtime.output)
    if trainer.schedule.rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        # beside the options (--precision auto), what this run chose on this machine
        write_json(output / "run.json", {**run_json, "chosen": {"precision": trainer.precision}})
        ckpt.save_frozen(
            output,
            trainer.frozen,
            trainer.frozen_record["fingerprint"],
            {"target_fingerprint": trainer.source.identity["target_fingerprint"]},
        )
    trainer.frozen = None  # the draft holds its copy


def check_room(trainer) -> None:
    """Before the first step: room for the next checkpoint (written beside the last before that one is
    removed): the trainable weights and AdamW's two moments, in fp32. The ranks stop together."""
    output = Path(trainer.cfg.runtime.output)
    need = sum(p.numel() for p in trainer.draft.parameters() if p.requires_grad) * 4 * 3
    free = shutil.disk_usage(output).free
    if distributed.any_rank(free < need):
        raise ArtifactError(
            f"{output} has {human_bytes(free)} free, and each checkpoint of this draft needs about "
            f"{human_bytes(need)} (its weights and optimizer state)",
            "free space there, or pass an -o on a disk with room (--resume continues a run "
            "moved there)",
        )


def save(trainer, step: int) -> Path | None:
    """A checkpoint after `step` steps (every rank takes part; rank 0 writes it): its folder.

    Under FSDP2 the model is gathered to rank 0 (model.safetensors, what export and eval read) but
    the optimizer state, twice the model's size, is not: each rank writes its own rows of it into
    the folder rank 0 then renames into place (the ranks share the run folder:
    distributed.check_shared_folder)."""
    output, s, o = trainer.cfg.runtime.output, trainer.schedule, trainer.cfg.optim
    model_state, optimizer_state = sharding.full_state(
        trainer.draft,
        trainer.optimizer,
        trainer.names,
        sharded=trainer.sharded,
        with_optimizer=not trainer.sharded,
    )
    staged = shards = None
    if trainer.sharded:
        if s.rank == 0:
            ckpt.begin_sharded_save(output, step)
        distributed.barrier()
        tensors, layout = sharding.local_optimizer_state(
            trainer.optimizer, trainer.names, trainer.params, s.rank, s.world
        )
        ckpt.write_optimizer_shard(ckpt.staging_dir(output, step), s.rank, s.world, tensors, layout)
        distributed.barrier()  # every shard written before rank 0 finishes the folder
        staged, shards = ckpt.staging_dir(output, step), s.world
    if s.rank != 0:
        return None
    if trainer.sharded:
        opt_tensors, groups = (
            None,
            [
                {**g, "params": [trainer.names[i] for i in g["params"]]}
                for g in optimizer_groups(trainer.optimizer)
            ],
        )
    else:
        opt_tensors, groups = ckpt.flatten_optimizer(optimizer_state, trainer.names)
    return ckpt.save_checkpoint(
        output,
        step,
        model_state,
        opt_tensors,
        _rng_state(trainer.device),
        trainer.draft_config.to_dict(),
        {
            "step": step,
            "epoch": s.epoch(step),
            "micro_batches_done": step * s.per_step,
            "total_steps": s.total_steps,
            "lr": lr_at(max(step - 1, 0), s.total_steps, o),
            "param_groups": groups,
            "world_size": s.world,
            "grad_accum": o.grad_accum,
            "precision": trainer.precision,
            "parallel": "fsdp" if trainer.sharded else ("ddp" if s.world > 1 else "single"),
            **({"curriculum": s.curriculum.state(step)} if s.curriculum is not None else {}),
        },
        keep_last=trainer.cfg.runtime.keep_last,
        frozen=trainer.frozen_record,
        staged=staged,
        shards=shards,
    )


def restore(trainer, checkpoint: Path) -> int:
    """Load a checkpoint of this run (weights, optimizer, RNG) into `trainer`; the step it was saved
    at."""
    s = trainer.schedule
    # a sharded checkpoint of as many ranks as this run: each rank reads its own rows alone
    own_rows = trainer.sharded and ckpt.optimizer_shards(checkpoint) == s.world
    parts = ckpt.load_checkpoint(
        checkpoint, resume=True, optimizer_rank=s.rank if own_rows else None
    )
    saved = (ckpt.checkpoint_meta(checkpoint).get("frozen") or {}).get("fingerprint")
    if saved is not None and saved != trainer.frozen_record["fingerprint"]:
        raise ArtifactError(
            f"--resume with a different input embedding than the run trained with "
            f"({checkpoint} was saved with embedding {saved}, the target's is now "
            f"{trainer.frozen_record['fingerprint']})",
            "resume with the same target and --dtype, or start a new run folder",
        )
    groups = parts["trainer_state"]["param_groups"]
    if own_rows:  # this rank's rows only: a slice of the model file and its own optimizer file
        held = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in parts["optimizer"]}
        missing = sorted(set(trainer.names) - held)
        if missing:
            raise ArtifactError(
                f"the optimizer shard of rank {s.rank} in {checkpoint} lacks {missing[:3]}",
                "resume from the checkpoint before it",
            )
        sharding.load_local_state(
            trainer.draft,
            trainer.optimizer,
            trainer.names,
            trainer.params,
            Path(checkpoint) / "model.safetensors",
            parts["optimizer"],
            groups,
            s.rank,
            s.world,
            frozen=parts["frozen_keys"],
        )
    else:
        optimizer_state = ckpt.unflatten_optimizer(parts["optimizer"], groups, trainer.names)
        sharding.load_full_state(
            trainer.draft,
            trainer.optimizer,
            parts["model"],
            optimizer_state,
            trainer.names,
            sharded=trainer.sharded,
            frozen=parts["frozen_keys"],
        )
    _restore_rng(parts["rng"], trainer.device)
    step = parts["trainer_state"]["step"]
    if s.curriculum is not None:  # MSD: the steps so far drew the sources this run would
        recorded, now = parts["trainer_state"].get("curriculum"), s.curriculum.state(step)
        if recorded != now:
            raise ArtifactError(
                f"{checkpoint} was trained on another curriculum ({recorded}; this run's "
                f"at step {step}: {now})",
                "resume with the options it was started with",
            )
    info(f"resuming from {checkpoint} (step {step})")
    say_precision(
        parts["trainer_state"].get("precision"),
        trainer.precision,
        trainer.cfg.runtime.precision,
        checkpoint,
    )
    return step


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a run draws from, as the saving rank (rank 0) holds them: the CPU's and, on CUDA,
    the one of the GPU it trains on (`torch_cuda`)."""
    state = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Every rank takes the saved states, the CUDA one into the generator of the GPU it trains on.

    The ranks start from one seed and draw alike (the same shapes: P-EAGLE's COD seed, a
    context-parallel group's shared batch), so rank r's cuda:r generator is where rank 0's cuda:0
    is; setting each rank's own device from rank 0's device is what resumes them all where they
    were. A checkpoint that holds every visible GPU's generator as rank 0's process saw them
    (`torch_cuda_<i>`, an older layout) gives its cuda:0's, the one rank 0 drew from; the others
    are not the ranks' own."""
    torch.set_rng_state(state["torch_cpu"])
    if device.type != "cuda":
        return
    if "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)
        return
    older = {int(k.rsplit("_", 1)[1]): v for k, v in state.items() if k.startswith("torch_cuda_")}
    if 0 in older:  # rank 0 drew from its device's generator, cuda:0 on one machine
        torch.cuda.set_rng_state(older[0], device)
