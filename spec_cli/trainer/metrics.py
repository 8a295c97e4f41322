"""What the trainer measures: the TTT metrics summed over micro-batches and ranks (`Metrics`), the
train record of a window of steps (`train_record`), an evaluation on the held-out batches
(`evaluate`), and the memory a rank peaked at. Where the records go: log.py.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from spec_cli import distributed
from spec_cli.draft.algorithm import Algorithm
from spec_cli.draft.losses import acceptance_length
from spec_cli.train_options import TrainConfig
from spec_cli.trainer.device import autocast
from spec_cli.trainer.sources import Source, supervise


def metric_steps(cfg: TrainConfig, algorithm: Algorithm) -> int:
    """How many steps the objective reports metrics for: the TTT depth, or what the algorithm says
    (Algorithm.steps(options): DFlash's block offsets)."""
    steps = algorithm.steps
    return int(steps(cfg.objective)) if steps else cfg.objective.ttt_steps


class Metrics:
    """Sums over micro-batches (and ranks) of the TTT metrics, kept on the compute device: adding a
    micro-batch's never waits for the device; the host reads them at a log step (`record`)."""

    def __init__(self, k: int, device: torch.device | None = None, context: int = 1):
        """context: ranks that share each batch (--context-parallel): each adds its share of the batch's
        losses and counts, and 1 / context of the batch itself."""
        zeros = lambda n: torch.zeros(n, dtype=torch.float64, device=device)  # noqa: E731
        self.loss, self.step_loss, self.correct, self.total = zeros(1), zeros(k), zeros(k), zeros(k)
        self.tokens, self.batches = zeros(1), zeros(1)
        self.share = 1.0 / context
        self.grad_norm, self.steps = zeros(1), 0  # the same on every rank: not reduced

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """One optimizer step's gradient norm (before clipping)."""
        self.grad_norm += norm.detach().double()
        self.steps += 1

    def add(self, out, tokens: int | torch.Tensor) -> None:
        self.loss += out.loss.detach().double()
        self.step_loss += out.step_loss.detach().double()
        self.correct += out.correct.double()
        self.total += out.total.double()
        self.tokens += tokens * self.share
        self.batches += self.share

    def all_reduce(self) -> None:
        if (
            distributed.world_size() > 1 and torch.distributed.is_initialized()
        ):  # not vLLM's own group
            flat = torch.cat(
                [self.loss, self.step_loss, self.correct, self.total, self.tokens, self.batches]
            )
            torch.distributed.all_reduce(flat)
            k = self.correct.numel()
            self.loss, self.step_loss, self.correct, self.total, self.tokens, self.batches = (
                flat.split([1, k, k, k, 1, 1])
            )

    def record(self) -> dict:
        n = max(float(self.batches), 1.0)
        acc = self.correct / self.total.clamp_min(1)  # [K] top-1 accuracy per TTT step
        record = {
            "loss": float(self.loss) / n,
            "step_loss": (self.step_loss / n).tolist(),
            "acc": acc.tolist(),
            "acceptance_length": float(acceptance_length(acc)),
            "tokens": int(round(float(self.tokens))),
        }
        if self.steps:  # the mean gradient norm of the optimizer steps in the record
            record["grad_norm"] = float(self.grad_norm) / self.steps
        return record


def train_record(trainer, window: Metrics, window_start: float, step: int, engine) -> dict:
    """The train record of the steps in `window` (summed over the ranks: every rank calls it), up to
    `step`; `engine`: the engine in the loop (rank 0), whose busy share of the window it adds."""
    window.all_reduce()
    elapsed = time.perf_counter() - window_start
    record = {
        "split": "train",
        "step": step,
        "lr": trainer.lr,
        **window.record(),
        "tokens_per_s": float(window.tokens) / max(elapsed, 1e-9),
        "steps_in_record": int(float(window.batches) / trainer.schedule.per_step) or 1,
        "peak_memory_gb": peak_memory_gb(trainer.device),
    }
    if engine is not None:  # how much of the window the engine was decoding beside training
        record["engine_busy"] = round(engine.busy_share(window_start, time.perf_counter()), 3)
    return record


def evaluate(
    objective: nn.Module,
    source: Source,
    eval_batches: list,
    cfg: TrainConfig,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    steps: int | None = None,
) -> dict | None:
    """The metrics of the held-out batches (shared out over the ranks, summed), the objective in
    eval mode, without gradients; None when the run holds none out."""
    if not eval_batches:
        return None
    context = cfg.runtime.context_parallel
    metrics = Metrics(steps or cfg.objective.ttt_steps, device, context)
    objective.eval()
    # (a context-parallel group's ranks take the same batches)
    rank, world = distributed.rank() // context, distributed.world_size() // context
    # Every rank runs the same number of forwards (sharded weights are gathered collectively); a rank
    # past the end repeats its last batch without counting it.
    rounds = -(-len(eval_batches) // world)
    with torch.no_grad(), autocast(device, autocast_dtype):
        for r in range(rounds):
            i = r * world + rank
            batch = supervise(
                source, eval_batches[min(i, len(eval_batches) - 1)], cfg.data.pack, device
            )
            out = objective(batch)
            if i < len(eval_batches):
                metrics.add(out, batch.num_tokens)
    objective.train()
    metrics.all_reduce()
    return metrics.record()


def peak_memory_gb(device: torch.device) -> float:
    """This rank's peak memory so far, in GiB: on a GPU the caching allocator's peak allocation on
    `device` (what a step needs, not what the allocator reserved); on a CPU the process's peak resident
    set (the model, the target and the batches included)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)  # KiB on Linux
