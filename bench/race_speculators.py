"""speculators 0.9.0 in the race (bench/race.py): its own EAGLE-3 draft, loss, optimizers, schedule
and checkpointer, driven one Feed row per optimizer step.

    pip install --no-deps speculators==0.9.0

What comes from speculators (imported, not re-written): the defaults (`TrainConfig()`, the
`speculators train` schema), the draft (`train.cli.build_draft_model` -> `Eagle3DraftModel`
`.from_training_args`, which loads the embeddings, the lm_head rows of the draft vocab and the aux
layer ids from the target folder), the TTT forward and its KL loss (`Eagle3DraftModel.forward`,
`get_trainer_kwargs`), the optimizers (`train.optimizers.build_optimizers`: Muon for the matrices,
AdamW for the rest), the schedule (`train.trainer._resolve_scheduler_steps` and transformers'
`get_linear_schedule_with_warmup`, as `Trainer.setup_optimizer` builds it) and the save
(`SingleGPUCheckpointer.save_checkpoint`, whose folder vLLM reads as it is). The loop below is the
body of `Trainer.train_epoch` (speculators/train/trainer.py:539-568) without its logging, recovery
and distributed parts. `adaptations()` lists every change; `settings()` every default with its line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

NAME = "speculators"
VERSION = "0.9.0"
ROWS = ("packed", 8192)  # DataArgs.total_seq_len: documents packed into rows of 8192 tokens

_SCHEMA = "speculators/train/config/schema.py"
_TRAINER = "speculators/train/trainer.py"


def settings() -> dict:
    """The defaults this run uses: name -> (value, where speculators sets it)."""
    cfg = _defaults()
    d, o, s, lo = cfg.draft, cfg.optimizer, cfg.scheduler, cfg.loss
    return {
        "rows": (f"packed, {cfg.data.total_seq_len} tokens, padded to it", f"{_SCHEMA}:211"),
        "row padding": ("document_ids -1, zero states", "speculators/train/data.py:405-442"),
        "position_ids": ("1 + position in its document", "speculators/models/eagle3/data.py:35"),
        "optimizer": (o.optimizer, f"{_SCHEMA}:340"),
        "muon/adamw split": (
            "Muon: 2-D matrices but embed_tokens/lm_head; AdamW: the rest",
            "speculators/train/optimizers.py:39-66",
        ),
        "lr (AdamW group)": (o.lr, f"{_SCHEMA}:344"),
        "muon_lr (= lr)": (o.muon_lr, f"{_SCHEMA}:797-798"),
        "weight_decay (AdamW group)": (o.weight_decay, f"{_SCHEMA}:346"),
        "muon_momentum": (o.muon_momentum, f"{_SCHEMA}:356"),
        "muon_weight_decay": (o.muon_weight_decay, f"{_SCHEMA}:359"),
        "muon_ns_steps": (o.muon_ns_steps, f"{_SCHEMA}:362"),
        "muon_adjust_lr_fn": (o.muon_adjust_lr_fn, f"{_SCHEMA}:365"),
        "scheduler": (f"{s.scheduler_type}, to 0", f"{_SCHEMA}:372, {_TRAINER}:416-423"),
        "warmup": ("total_steps // 100", f"{_TRAINER}:205-206"),
        "grad clip": (1.0, f"{_TRAINER}:551"),
        "loss": (lo.loss_fn, f"{_SCHEMA}:805-806"),
        "ttt_steps": (lo.ttt_steps, f"{_SCHEMA}:317"),
        "ttt_step_loss_decay": (lo.ttt_step_loss_decay, f"{_SCHEMA}:322"),
        "num_layers": (d.num_layers, f"{_SCHEMA}:799-800"),
        "draft_arch": (d.draft_arch, f"{_SCHEMA}:789-790"),
        "norm_before_residual": (d.norm_before_residual, f"{_SCHEMA}:146"),
        "norm_before_fc": (d.norm_before_fc, f"{_SCHEMA}:791-792"),
        "norm_output": (d.norm_output, f"{_SCHEMA}:793-794"),
        "fc_norm": (d.fc_norm, f"{_SCHEMA}:162"),
        "sliding_window (every layer)": (
            d.sliding_window,
            f"{_SCHEMA}:173, speculators/train/cli.py:211-214",
        ),
        "target_layer_ids": ("[2, n // 2, n - 3]", "speculators/models/utils.py:111"),
        "embeddings": ("the target's, frozen", f"{_SCHEMA}:150, speculators/model.py:161-169"),
        "lm_head": ("the target's rows at t2d, frozen", "speculators/model.py:171-183, 204-205"),
        "dtype": (
            f"fp32 weights, {cfg.data.hidden_states_dtype} autocast on CUDA",
            f"{_SCHEMA}:219, {_TRAINER}:539-541",
        ),
        "save": ("bf16 safetensors + config.json", "speculators/train/checkpointer.py:339-359"),
        "num_speculative_tokens (= ttt_steps)": (
            lo.ttt_steps,
            "speculators/models/eagle3/core.py:414",
        ),
    }


def adaptations() -> list[str]:
    """Every change from `speculators train`, one line each."""
    return [
        "data: the race's Feed (a spec_cli feature cache) replaces the speculators dataset and "
        "DataLoader; rows packed by spec_cli's plan_packed, padded to 8192 as CollateFn pads",
        "teacher: verifier_norm and verifier_lm_head are nn.Identity and the teacher is fed as "
        "log(target_p): softmax(teacher) is the cache's target distribution over the draft vocab",
        "packed rows keep each document's last slot (input id 0, loss mask 0) that speculators' "
        "shift_batch drops: it predicts nothing and no slot attends to it",
        "CPU: draft_attn_impl 'sdpa' (the default simple_flex_attention has no CPU backward) and "
        "loss_implementation 'eager' (the default 'fused' is Triton); CUDA keeps both defaults",
        "CPU: fp32 throughout (the trainer's bf16 autocast and bf16 hidden states are CUDA's); "
        "CUDA: bf16 autocast with the aux states in bf16, as the trainer runs",
        "embeddings: copied from the Feed's head (the target's input embedding) after "
        "load_verifier_weights read the same matrix from the target folder",
        "schedule and stop: one epoch of total_steps rows (the race's), not 20 epochs of the data; "
        "the loop stops early at max_seconds",
        "save: once, at the end, as epoch 0 (the trainer saves after every epoch); no validation",
        "seed: the race's seed (default 42)",
    ]


def _defaults():
    from speculators.train.config import TrainConfig

    return TrainConfig()


def _runtime() -> dict:
    """Where the draft trains and with what: speculators' defaults where they run (CUDA), else the
    CPU stand-ins (adaptations())."""
    if torch.cuda.is_available():
        return dict(
            device=torch.device("cuda"),
            attn="simple_flex_attention",
            loss="fused",
            autocast=torch.bfloat16,
        )
    return dict(device=torch.device("cpu"), attn="sdpa", loss="eager", autocast=None)


class _Run:
    """speculators' draft, optimizers and schedulers for `total_steps` steps, built as
    `speculators train` (cli.main) builds them."""

    def __init__(self, feed, total_steps: int, seed: int):
        from speculators.model import SpeculatorModel
        from speculators.train.cli import build_draft_model, set_seed
        from speculators.train.config import TrainConfig
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
        from transformers import get_linear_schedule_with_warmup

        rt = _runtime()
        self.device, self.autocast = rt["device"], rt["autocast"]
        set_seed(seed)
        torch.manual_seed(seed)
        cfg = TrainConfig(
            seed=seed,
            verifier={"verifier_name_or_path": str(feed.target)},
            draft={"draft_attn_impl": rt["attn"]},
            loss={"loss_implementation": rt["loss"]},
        )
        args = argparse.Namespace(**cfg.flatten())  # what cli.main hands the model classes
        model_class = SpeculatorModel.registry["eagle3"]
        head = feed.head
        model = build_draft_model(
            args, model_class, head.t2d, head.d2t, head.selected_token_ids.numel()
        )
        expected = [layer + 1 for layer in feed.aux_layers]  # output of layer l = input of l + 1
        if list(model.target_layer_ids) != expected:
            raise ValueError(
                f"speculators reads aux layers {model.target_layer_ids}, the cache holds "
                f"the inputs of {expected}"
            )
        with torch.no_grad():
            model.embed_tokens.weight.copy_(head.embed_tokens)
        model.verifier_norm = torch.nn.Identity()  # the teacher comes as log(target_p)
        model.verifier_lm_head = torch.nn.Identity()
        self.model = model.to(self.device)
        self.call_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
        self.ttt_steps = args.ttt_steps
        self.trainer_config = TrainerConfig(
            lr=args.lr,
            num_epochs=1,
            save_path="",
            optimizer=args.optimizer,
            weight_decay=args.weight_decay,
            muon_lr=args.muon_lr,
            muon_momentum=args.muon_momentum,
            muon_weight_decay=args.muon_weight_decay,
            muon_ns_steps=args.muon_ns_steps,
            muon_adjust_lr_fn=args.muon_adjust_lr_fn,
            scheduler_type=args.scheduler_type,
            max_steps=total_steps,
        )
        self.optimizers = build_optimizers(self.model, self.trainer_config)
        warmup, total = _resolve_scheduler_steps(self.trainer_config, total_steps)
        self.schedulers = [
            get_linear_schedule_with_warmup(opt, warmup, total) for opt in self.optimizers
        ]
        self.row_tokens = feed.row_tokens

    def inputs(self, batch) -> dict:
        """A Feed row as speculators' collated, shifted batch: [1, R] with R = max(T, 8192)."""
        T = batch.input_ids.shape[1]
        R = max(T, self.row_tokens)  # CollateFn pads every row to total_seq_len
        lens = batch.seq_lens[0] if batch.seq_lens is not None else torch.tensor([T])
        doc = torch.repeat_interleave(torch.arange(lens.numel()), lens)  # [T]
        start = torch.cumsum(lens, 0) - lens
        pad = lambda x, value=0: _pad_right(x, R, value)
        hidden = batch.aux_hidden  # [1, T, 3H]
        if self.autocast is not None:
            hidden = hidden.to(self.autocast)  # the dataloader's hidden_states_dtype
        out = dict(
            hidden_states=pad(hidden),
            input_ids=pad(batch.input_ids),
            document_ids=pad(doc[None], -1),
            loss_mask=pad(batch.loss_mask.bool()),
            position_ids=pad((torch.arange(T) - start[doc] + 1)[None]),  # shift_batch: from 1
            verifier_last_hidden_states=pad(batch.target_p.clamp_min(1e-30).log()),  # [1, R, Vd]
        )
        return {k: v.to(self.device) for k, v in out.items()}

    def step(self, batch) -> tuple[float, float]:
        """One optimizer step on one row, as Trainer.train_epoch takes it: (loss, lr)."""
        inputs = self.inputs(batch)
        precision = (
            torch.autocast(self.device.type, dtype=self.autocast)
            if self.autocast is not None
            else contextlib.nullcontext()
        )
        with precision:
            _, loss, _ = self.model(**inputs, **self.call_kwargs)
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for opt in self.optimizers:
            opt.step()
        lr = self.optimizers[0].param_groups[0]["lr"]
        for scheduler in self.schedulers:
            scheduler.step()
        return float(loss.detach()), lr

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _pad_right(x: torch.Tensor, length: int, value=0) -> torch.Tensor:
    """x [1, T, ...] padded with `value` to [1, length, ...]."""
    return torch.nn.functional.pad(
        x, (0, 0) * (x.dim() - 2) + (0, length - x.shape[1]), value=value
    )


def step_seconds(feed, steps: int = 6, seed: int = 0) -> float:
    """Median seconds per optimizer step (row read included) after 2 warm-up steps; nothing
    saved."""
    run = _Run(feed, steps + 2, seed)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        run.step(feed.batch(i))
        run.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def train(
    feed, out: Path, total_steps: int, max_seconds: float | None, seed: int, log=print
) -> dict:
    """Train speculators' draft on feed rows 0..total_steps-1 (one per step), save it with its own
    checkpointer into out/"saved"/"0" (the folder vLLM reads) and say what was done."""
    from speculators.train.checkpointer import SingleGPUCheckpointer

    run = _Run(feed, total_steps, seed)  # seeds torch (and random, numpy) as speculators does
    run.model.train()
    steps = tokens = 0
    losses: list[float] = []
    seconds, last_log = 0.0, 0.0
    for i in range(total_steps):
        if max_seconds is not None and seconds >= max_seconds:
            break
        t0 = time.perf_counter()
        loss, lr = run.step(feed.batch(i))
        run.sync()
        seconds += time.perf_counter() - t0
        steps, tokens = steps + 1, tokens + feed.row_tokens_of(i)
        if i == 0 or seconds - last_log >= 30 or i == total_steps - 1:
            last_log = seconds
            losses.append(loss)
            log(
                f"{NAME} step {steps}/{total_steps} loss {loss:.4f} lr {lr:.2e} "
                f"{tokens / seconds:.0f} tok/s"
            )
    SingleGPUCheckpointer(Path(out) / "saved").save_checkpoint(run.model, run.optimizers, 0)
    folder = Path(out) / "saved" / "0"
    config = json.loads((folder / "config.json").read_text())
    proposals = config.get("speculators_config", {}).get("proposal_methods") or [{}]
    return {
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "folder": str(folder),
        "num_speculative_tokens": proposals[0].get("speculative_tokens"),
        "losses": losses,
    }
