"""`Trainer`: this rank's draft, objective and optimizer, and what the loop asks of them: the
learning rate, a micro-batch's forward and backward, an optimizer step, an evaluation.

Built in one pass, in this order: the draft through its algorithm (draft.py); the step's precision,
its attention kernel and, on a GPU, activation checkpointing when the step would not fit without it
(device.py); the objective over the draft; --context-parallel's split of the rows; FSDP2's sharding
(before the optimizer, which holds the sharded weights); the optimizer over the trained parameters
in its groups' order. The DDP wrapper comes later (`make_model`), once a resume has loaded the
weights. Saving and restoring a Trainer: checkpoints.py.
"""

from __future__ import annotations

import torch

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.console import info
from spec_cli.draft import sharding
from spec_cli.draft.algorithm import Algorithm
from spec_cli.draft.optim import ordered, scheduled_lr, set_lr
from spec_cli.draft.step import forward_backward, make_optimizer, optimizer_step
from spec_cli.train_options import TrainConfig
from spec_cli.trainer.device import (
    autocast,
    checkpointing_needed,
    choose_attention,
    replicated,
    split_rows,
    step_precision,
)
from spec_cli.trainer.draft import build_draft
from spec_cli.trainer.metrics import evaluate, metric_steps
from spec_cli.trainer.sources import Schedule, Source


class Trainer:
    """This rank's draft, optimizer and objective (DDP or FSDP2 under torchrun)."""

    def __init__(
        self,
        cfg: TrainConfig,
        algorithm: Algorithm,
        source: Source,
        vocab_map,
        schedule: Schedule,
        device: torch.device,
        auto_checkpointing: bool = False,
    ):
        """auto_checkpointing: on a GPU, turn activation checkpointing on when the step would not fit the
        GPU's free memory without it (spec plan's measure; `needs_checkpointing`)."""
        self.cfg, self.algorithm, self.source, self.schedule = cfg, algorithm, source, schedule
        self.device = device
        self.draft, self.draft_config, self.frozen = build_draft(cfg, algorithm, source, vocab_map)
        self.frozen_record = {
            "keys": sorted(self.frozen),
            "fingerprint": ckpt.frozen_fingerprint(self.frozen),
        }
        self.draft.to(device)
        self.autocast_dtype = step_precision(cfg.runtime.precision, device)
        self.precision = (
            "bf16" if self.autocast_dtype is not None else "fp32"
        )  # as run here: recorded
        self.attention = choose_attention(
            self.draft, cfg.runtime.attention, device, self.autocast_dtype, cfg.data.pack
        )
        self.checkpointing = cfg.runtime.activation_checkpointing
        if not self.checkpointing and auto_checkpointing and device.type == "cuda":
            self.checkpointing = checkpointing_needed(
                cfg, algorithm, self.draft, self.draft_config, source, device, self.autocast_dtype
            )
        # the algorithm's objective over the draft (the module evaluation runs)
        self.objective = algorithm.objective(
            self.draft, cfg.objective, activation_checkpointing=self.checkpointing
        )
        if (
            schedule.context > 1
        ):  # --context-parallel: the objective splits each batch's rows over its group
            split_rows(self.objective, self.draft, source, schedule.context)
        self.sharded = (
            cfg.runtime.fsdp and schedule.world > 1
        )  # FSDP2; else DDP replicates the draft
        if self.sharded:
            sharding.shard(
                self.objective, device
            )  # before the optimizer: it holds the sharded weights
        elif cfg.runtime.fsdp:
            info("--fsdp shards across torchrun processes; with one process it trains as usual")
        # in the optimizer's group order (its state_dict numbers parameters so; checkpoints name them)
        trained = ordered(
            [(n, p) for n, p in self.draft.named_parameters() if p.requires_grad], cfg.optim
        )
        self.names, self.params = [n for n, _ in trained], [p for _, p in trained]
        self.optimizer = make_optimizer(self.params, cfg.optim, self.names)

    def make_model(self) -> None:
        """The module the loop trains: the objective, or under torchrun without --fsdp its DDP wrapper
        (made once the weights are restored: DDP starts every rank from rank 0's)."""
        self.model = self.objective
        if self.schedule.world > 1 and not self.sharded:
            self.model = replicated(self.objective, self.device)

    @property
    def lr(self) -> float:
        return scheduled_lr(self.optimizer)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def forward_backward(self, batch, sync: bool):
        """One micro-batch's loss and gradients; `sync`: the step's last, whose gradients the ranks share."""

        def hold_gradients():
            return (
                sharding.no_gradient_sync(self.objective) if self.sharded else self.model.no_sync()
            )

        return forward_backward(
            self.objective,
            self.model,
            batch,
            self.cfg.optim.grad_accum,
            autocast(self.device, self.autocast_dtype),
            hold_gradients if self.schedule.world > 1 else None,
            sync,
            gradient_scale=self.schedule.context,
        )

    def optimizer_step(self) -> torch.Tensor:
        """The step; the gradients' global norm before clipping (on the device)."""
        return optimizer_step(self.params, self.optimizer, self.cfg.optim.grad_clip)

    def evaluate(self) -> dict | None:
        """The held-out batches' metrics (metrics.evaluate); None when the run holds none out."""
        return evaluate(
            self.objective,
            self.source,
            self.schedule.eval,
            self.cfg,
            self.device,
            self.autocast_dtype,
            metric_steps(self.cfg, self.algorithm),
        )
