"""SpecForge 0.2.0 in the race (bench/race.py): its own EAGLE-3 draft, objective, optimizer,
schedule, checkpoint and HF export, driven one cache row per optimizer step.

    pip install --no-deps specforge==0.2.0

SpecForge's trainer (`specforge train`) reads its features from an SGLang capture server or from its
own offline .ckpt files; here they come from bench/race_data.py's Feed instead, and everything after
that is SpecForge's own code, as its TrainerCore runs it (training/controller.py:328-353):

    out = Eagle3TrainStrategy.forward_loss(batch)   # OnlineEagle3Model, sum_k 0.8**k * ploss_k
    out.loss.backward()
    BF16Optimizer.step()                            # clip 0.5, AdamW on fp32 masters, cosine lr

The target SpecForge reads (its config.json, embedding and vocab map) is a stand-in folder written
from the Feed, so SpecForge's own readers build the draft and export it. adaptations() lists every
change from its own run; settings() the defaults kept, each with its source line in site-packages.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import peers  # bench/peers.py (this script's folder is on sys.path)
import torch
from safetensors.torch import save_file

NAME = "specforge"
VERSION = "0.2.0"
ROWS = ("single", 2048)  # batch 1, one conversation per row cut at data.max_length
RUN_ID = "race"
ATTENTION = "sdpa"  # its default "flex_attention" has no CPU backward (torch: "FlexAttention
# does not support backward on CPU"); "sdpa" is the eager cache_hidden path it also ships


def settings() -> dict:
    """name -> (value, where SpecForge 0.2.0 sets it, under site-packages/specforge/)."""
    return {
        "learning_rate": (1e-4, "config/schema.py:523"),
        "lr_scheduler": ("cosine, linear warmup, eta_min 0", "lr_scheduler.py:93-119"),
        "warmup_ratio": (
            0.015,
            "config/schema.py:525 (warmup int(0.015 * steps), optimizer.py:61)",
        ),
        "optimizer": ("AdamW on fp32 masters (BF16Optimizer)", "optimizer.py:12-44"),
        "adamw_betas_eps": ("(0.9, 0.999), 1e-8: torch's defaults", "optimizer.py:42-44"),
        "weight_decay": (0.0, "optimizer.py:20"),
        "max_grad_norm": (0.5, "config/schema.py:526, applied in optimizer.py:140-163"),
        "batch_size": (1, "config/schema.py:520"),
        "accumulation_steps": (1, "config/schema.py:521"),
        "max_length": (2048, "config/schema.py:140"),
        "ttt_length": (7, "config/schema.py:530"),
        "step_weight": (0.8, "training/strategies/base.py:147 (loss at :291-292)"),
        "loss": ("-(position_mask * p * log_softmax).sum(-1).mean()", "core/loss.py:15-21"),
        "lk_loss_type": (None, "config/schema.py:541"),
        "torch_dtype": ("bfloat16, on CPU too (it runs there)", "config/schema.py:73"),
        "num_hidden_layers": (1, "algorithms/eagle3/providers.py:184"),
        "draft_config": ("from the target's config", "training/model_loading.py:211-258"),
        "norm_output": (True, "modeling/draft/llama3_eagle.py:1690"),
        "fc_norm": (False, "modeling/draft/llama3_eagle.py:1679"),
        "embeddings": ("the target's, frozen", "algorithms/model_providers.py:106-111"),
        "lm_head": ("random init (initializer_range), trained", "llama3_eagle.py:1691-1701"),
        "aux_layers": ("[1, n//2 - 1, n - 4] = [1, 14, 26]", "algorithms/model_providers.py:204"),
        "save": ("CheckpointManager.save: training_state.pt", "training/controller.py:839-878"),
        "export": ("export_to_hf: config.json + model.safetensors", "export/to_hf.py:68-118"),
    }


def adaptations() -> list[str]:
    """Every change from SpecForge's own `specforge train` + `specforge export --to hf` run."""
    return [
        "features: the race's cache rows (bench/race_data.py, rows 'single' cut at 2048), not "
        "SGLang capture or SpecForge's offline .ckpt files; one row per optimizer step, in the "
        "Feed's order (seed) instead of SpecForge's sampler",
        "teacher: SpecForge reads full-vocab target logits; it gets log(target_p) at the draft "
        "columns and -inf elsewhere, and a top logit at the target's argmax where that lies "
        "outside the draft vocab, so its softmax over the draft vocab is target_p and its "
        "position_mask (t2d[argmax] & loss_mask) and accuracy targets are the cache's",
        "aux states: the cache's fp32 rows cast to the draft's bfloat16 (the cache stores "
        "bfloat16)",
        "target folder: a stand-in written from the Feed (its config.json, "
        "model.embed_tokens.weight and a t2d/d2t file in SpecForge's format, "
        "torch.save({'d2t', 't2d'})), read by SpecForge's own draft-config generator, "
        "load_embedding, load_vocab_mapping and export",
        "draft_vocab_size: the cache's vocab map (4096 on the quick cache) instead of the default "
        "32000 with SpecForge's own frequency-built map",
        f"attention_backend: '{ATTENTION}' instead of 'flex_attention' (no CPU backward)",
        "loss on CPU: SpecForge's torch reference _compute_loss (core/loss.py:15) in place of its "
        "Triton LogSoftmaxLoss (GPU only); on CUDA its LogSoftmaxLoss runs",
        "no OnlineEagle3Model target head: the teacher arrives as logits (build_eagle3_model loads "
        "a TargetHead from the target's lm_head for offline hidden states)",
        "one process, no FSDP/DDP wrap (single rank: the same math)",
        "seed: the race's, not training.seed 42; total_steps: the race's (its schedule horizon)",
        "save: CheckpointManager.save with the payload TrainerController.save_checkpoint forms; "
        "the draft config it was built with is written as saved/draft_config.json (what "
        "`specforge export --draft-config` takes: SpecForge does not write it itself)",
        "vllm folder: export_to_hf(checkpoint, draft_config, embedding_source=the stand-in target)",
    ]


# ---------------------------------------------------------------------------------------------
# building


def _stand_in_target(feed, folder: Path) -> Path:
    """The target as SpecForge reads it, from the Feed: config.json, the input embedding
    (model.safetensors) and the draft vocab map (vocab_mapping.pt, SpecForge's format)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(feed.target_config))
    embed = feed.head.embed_tokens.contiguous()  # [V, H]
    save_file({"model.embed_tokens.weight": embed}, str(folder / "model.safetensors"))
    torch.save({"d2t": feed.head.d2t, "t2d": feed.head.t2d}, folder / "vocab_mapping.pt")
    return folder


def _config(feed, target: Path, total_steps: int, seed: int):
    """SpecForge's run config: its defaults, plus what the race decides (see adaptations())."""
    from specforge.config import Config

    model = dict(target_model_path=str(target), vocab_mapping_path=str(target / "vocab_mapping.pt"))
    # an offline run's data source; SpecForge reads no data here (the Feed gives the rows)
    data = dict(hidden_states_path=str(feed.backend.reader.folder))
    training = dict(attention_backend=ATTENTION, max_steps=total_steps, seed=seed)
    return Config.model_validate(dict(model=model, data=data, training=training, run_id=RUN_ID))


def _use_reference_loss() -> None:
    """On CPU: SpecForge's torch reference loss in place of its Triton kernel (peers.py)."""
    import specforge.core.loss as sf_loss

    peers._ReferenceLoss.fn = sf_loss._compute_loss  # as shipped: under its torch.compile
    peers._import("specforge").LogSoftmaxLoss = peers._ReferenceLoss


def _build(feed, target: Path, total_steps: int, seed: int):
    """(cfg, draft_config, strategy, optimizer): SpecForge's own pieces, built as its assembly does
    (training/assembly.py, algorithms/model_providers.py:91-112 and 255-271)."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.algorithms.eagle3.providers import algorithm_providers, build_step
    from specforge.algorithms.model_providers import _device, _torch_dtype, build_eagle3_draft
    from specforge.optimizer import BF16Optimizer
    from specforge.training.model_loading import resolve_draft_config

    if _device().type == "cpu":
        _use_reference_loss()
    cfg = _config(feed, target, total_steps, seed)
    t = cfg.training
    draft_config = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    draft_config.draft_vocab_size = int(feed.head.selected_token_ids.numel())
    torch.manual_seed(seed)
    draft = build_eagle3_draft(cfg, draft_config)  # embedding + vocab map loaded, embedding frozen
    model = OnlineEagle3Model(
        draft,
        length=t.ttt_length,
        attention_backend=t.attention_backend,
        lk_loss_type=t.lk_loss_type,
        kl_scale=t.kl_scale,
        kl_decay=t.kl_decay,
    ).to(device=_device(), dtype=_torch_dtype(cfg))
    strategy = build_step(model)  # Eagle3TrainStrategy: sum_k 0.8**k * ploss_k
    optimizer = BF16Optimizer(  # as training/assembly.py:266-274 builds it
        draft,
        lr=t.learning_rate,
        max_grad_norm=t.max_grad_norm,
        warmup_ratio=t.warmup_ratio,
        lr_scheduler=t.lr_scheduler,
        total_steps=total_steps,
        offload_master=t.optimizer_cpu_offload,
    )
    return cfg, draft_config, strategy, optimizer


# ---------------------------------------------------------------------------------------------
# one step


def _teacher(batch, t2d: torch.Tensor) -> torch.Tensor:
    """[B, T, V] the full-vocab target logits SpecForge takes, rebuilt from the cache's row:
    log target_p at the draft columns (so softmax over them is target_p), -inf elsewhere, and a top
    logit (1 > every log p) at the target's argmax where it is outside the draft vocab, so that
    SpecForge's argmax, and with it position_mask = t2d[argmax] & loss_mask, is the cache's. Only
    its metric target_p_on_draft (acceptance rate) differs from what a real target gives."""
    B, T, _ = batch.target_p.shape
    target = torch.full((B, T, t2d.numel()), -math.inf, device=t2d.device)
    target[..., t2d] = batch.target_p.clamp_min(1e-30).log()
    outside = ~t2d[batch.target_ids]  # [B, T]
    target[outside, batch.target_ids[outside]] = 1.0
    return target


def _train_batch(batch, t2d: torch.Tensor, dtype: torch.dtype):
    """A Feed row as SpecForge's TrainBatch (runtime/contracts.py:119), the tensors its offline
    collator and TargetHead.preprocess hand the strategy: ids and masks already shifted."""
    from specforge.runtime.contracts import TrainBatch

    batch = batch.to(t2d.device)
    tensors = dict(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        loss_mask=batch.loss_mask[..., None],  # [B, T, 1]
        hidden_state=batch.aux_hidden.to(dtype),  # [B, T, 3H]
        target=_teacher(batch, t2d),
    )
    return TrainBatch(sample_ids=["row"], strategy="eagle3", tensors=tensors)


def _step(strategy, optimizer, batch, t2d, dtype) -> tuple[float, float]:
    """One optimizer step as TrainerCore.train_step runs it (accumulation 1). Returns SpecForge's
    loss and step 0's soft-CE over the supervised slots (ploss_0 is a mean over all T slots), which
    compares across rows of different loss density."""
    out = strategy.forward_loss(_train_batch(batch, t2d, dtype))
    out.loss.backward()
    optimizer.step()  # clip, AdamW on the fp32 masters, lr schedule, copy back to the draft
    T = batch.input_ids.shape[1]
    ce0 = float(out.metrics["plosses"][0]) * T / max(int(batch.position_mask.sum()), 1)
    return float(out.loss.detach()), ce0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# the race's entry points


def step_seconds(feed, steps: int = 6, seed: int = 0) -> float:
    """Median seconds per optimizer step (row fetch included) after 2 warm-up steps; nothing
    saved."""
    with tempfile.TemporaryDirectory() as tmp:
        target = _stand_in_target(feed, Path(tmp) / "target")
        cfg, _, strategy, optimizer = _build(feed, target, 2 + steps, seed)
        t2d = strategy.eagle3_model.draft_model.t2d
        dtype = getattr(torch, cfg.model.torch_dtype)
        times = []
        for i in range(2 + steps):
            start = time.perf_counter()
            _step(strategy, optimizer, feed.batch(i), t2d, dtype)
            _sync()
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def train(
    feed, out: Path, total_steps: int, max_seconds: float | None, seed: int, log=print
) -> dict:
    """Train SpecForge's draft on feed.batch(i), i < total_steps (stopping after max_seconds of
    training), save its checkpoint into out/saved and export the folder vLLM reads to out/vllm."""
    from specforge.export.to_hf import export_to_hf
    from specforge.training.backend import FSDPTrainingBackend
    from specforge.training.checkpoint import CheckpointManager

    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        target = _stand_in_target(feed, Path(tmp) / "target")
        cfg, draft_config, strategy, optimizer = _build(feed, target, total_steps, seed)
        model = strategy.eagle3_model
        t2d = model.draft_model.t2d
        dtype = getattr(torch, cfg.model.torch_dtype)

        steps = tokens = 0
        losses, seconds, last_log = [], 0.0, 0.0
        start = time.perf_counter()
        for i in range(total_steps):
            lr = optimizer.get_learning_rate()  # this step's
            loss, ce0 = _step(strategy, optimizer, feed.batch(i), t2d, dtype)
            steps, tokens = steps + 1, tokens + feed.row_tokens_of(i)
            seconds = time.perf_counter() - start
            last = steps == total_steps or (max_seconds is not None and seconds >= max_seconds)
            if seconds - last_log >= 30 or steps == 1 or last:
                last_log = seconds
                losses.append(loss)
                log(
                    f"{NAME} step {steps}/{total_steps} loss {loss:.4f} (step-0 CE {ce0:.3f}) "
                    f"lr {lr:.2e} {tokens / seconds:.0f} tok/s"
                )
            if last:
                break

        # save as TrainerController.save_checkpoint does (training/controller.py:839-878)
        saved = out / "saved"
        saved.mkdir(parents=True, exist_ok=True)
        draft_config.to_json_file(str(saved / "draft_config.json"))
        epoch, rows = divmod(steps, len(feed))
        state = {
            "draft_state_dict": strategy.checkpoint_state_filter(model.state_dict()),
            "global_step": steps,
            "epoch": epoch,
            "epoch_batch": rows,
            "epoch_samples": rows,
            "strategy": strategy.name,
            "run_id": RUN_ID,
            "world_size": 1,
        }
        rank_state = {"optimizer": optimizer.state_dict(), "rng": FSDPTrainingBackend._rng_state()}
        checkpoint = CheckpointManager(str(saved), RUN_ID).save(state, steps, rank_state=rank_state)
        folder = export_to_hf(
            checkpoint,
            str(saved / "draft_config.json"),
            str(out / "vllm"),
            embedding_source=str(target),
        )
    return {
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "folder": str(folder),
        "num_speculative_tokens": None,  # SpecForge's config carries none: vLLM is told
        "losses": losses,
    }
