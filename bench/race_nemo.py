"""NeMo AutoModel 0.7.0 in the race (bench/race.py): its own EAGLE-3 draft, loss, optimizer,
schedule, checkpointer and vLLM export, driven by a short loop over the race's shared data
(bench/race_data.py).

NeMo AutoModel is installed --no-deps in its own venv, so that its pins do not touch the system's
torch and transformers; its site-packages joins sys.path after the system's paths (NEMO_SITE, or the
environment variable of that name). Its recipe, recipes/llm/train_eagle3.py (TrainEagle3Recipe),
does not import here (torchao), so the loop below is that recipe's single-rank step
(train_eagle3.py:2046-2081) written out, on its own pieces:

    draft  components/speculative/eagle/draft_llama.py  LlamaEagle3DraftModel (1 decoder layer)
    loss   components/speculative/eagle/core.py         Eagle3TrainerModule, offline-cache inputs
    lr     recipes/llm/_spec_train_utils.py              make_warmup_cosine_schedule
    save   components/checkpoint                         Checkpointer.save_model
    vLLM   components/speculative/serve_vllm.py          resolve_draft_artifacts (_export_for_vllm)

The defaults come from the recipe and from examples/speculative/eagle3/llama_eagle3_mvp.yaml in
NeMo's GitHub repository (the wheel ships no YAML); settings() names each one's source.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

NAME = "nemo"
VERSION = "0.7.0"
NEMO_SITE = os.environ.get("NEMO_SITE", "/tmp/nemo-venv/lib/python3.11/site-packages")
ROWS = ("single", 1024)  # one conversation per row, seq_length 1024, micro batch 1
PAD_ROWS = True  # pad each row to ROWS[1] tokens, as NeMo's dataloader does (padding="max_length")
TTT_STEPS = 4
LR = 1e-4
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.0
WARMUP_RATIO = 0.05
MIN_LR_RATIO = 0.1
MAX_GRAD_NORM = 1.0
LOG_EVERY_S = 30.0

_RECIPE = "recipes/llm/train_eagle3.py"
_YAML = "examples/speculative/eagle3/llama_eagle3_mvp.yaml (GitHub)"


def _import_nemo() -> None:
    """Make nemo_automodel importable, the system's packages first, and check its version."""
    if NEMO_SITE not in sys.path:
        sys.path.append(NEMO_SITE)
    from importlib.metadata import version

    if version("nemo_automodel") != VERSION:
        raise RuntimeError(
            f"nemo_automodel {version('nemo_automodel')} at {NEMO_SITE}: want {VERSION}"
        )


def settings() -> dict:
    """The defaults this run uses: name -> (value, source). Sources are under nemo_automodel/."""
    return {
        "draft": (
            "LlamaEagle3DraftModel, 1 decoder layer",
            "speculative/eagle/registry.py:74-76; speculative/eagle/draft_llama.py:760",
        ),
        "attn_implementation": ("eager", f"{_RECIPE}:627"),
        "fc_norm / norm_output": ((False, False), f"{_RECIPE}:635-636"),
        "dtype": ("fp32 on CPU, bf16 on CUDA", f"{_RECIPE}:566"),
        "embeddings": ("copied from the target, frozen", f"{_RECIPE}:665,676; {_YAML}:41"),
        "lm_head": (
            "random init (HF post_init), trained",
            "speculative/eagle/draft_llama.py:810,831",
        ),
        "d2t / t2d": ("in the draft's weights", f"{_RECIPE}:669"),
        "ttt_steps": (TTT_STEPS, f"{_YAML}:33; {_RECIPE}:739"),
        "loss": (
            "sum_k 0.8**k * softCE_k / sum_k 0.8**k; softCE over the draft vocab, mean over the "
            "supervised positions",
            "speculative/eagle/core.py:456,490,514; components/loss/soft_ce.py:28-63",
        ),
        "optimizer": (
            f"torch AdamW lr {LR} betas {BETAS} weight_decay {WEIGHT_DECAY}",
            f"{_RECIPE}:773-778; {_YAML}:58-60",
        ),
        "lr schedule": (
            f"linear warmup {WARMUP_RATIO:.0%} of the steps, cosine to {MIN_LR_RATIO} x lr, "
            "per optimizer step",
            f"{_RECIPE}:816-820; recipes/llm/_spec_train_utils.py:172",
        ),
        "max_grad_norm": (MAX_GRAD_NORM, f"{_YAML}:52; {_RECIPE}:2078"),
        "batch": ("micro batch 1, grad accumulation 1", f"{_YAML}:29-30"),
        "rows": (
            f"one conversation per row, cut at {ROWS[1]} tokens, padded to {ROWS[1]}",
            f"{_YAML}:28; components/datasets/llm/eagle3.py:195-196",
        ),
        "aux layers": (
            "outputs of target layers [1, 14, 26] (vLLM's ids [2, 15, 27]); not in the config",
            "speculative/eagle/target.py:53",
        ),
        "save": (
            "Checkpointer.save_model, safetensors, consolidated",
            f"{_RECIPE}:1570-1580,1659; {_YAML}:66",
        ),
        "vllm folder": (
            "resolve_draft_artifacts -> _export_for_vllm",
            "speculative/serve_vllm.py:320,397",
        ),
        "num_speculative_tokens": (
            "not in the saved config (vLLM is told it; NeMo's own decode eval passes ttt_steps)",
            f"speculative/serve_vllm.py:459-478; {_RECIPE}:860",
        ),
    }


def adaptations() -> list[str]:
    """Every change from NeMo's own training script (TrainEagle3Recipe), one line each."""
    return [
        "data: the race's cache rows (race_data.Feed, one conversation per row, its own order) go "
        "into Eagle3TrainerModule's offline-cache inputs (target_probs + position_mask), as "
        "NeMo's cached_target_path does (train_eagle3.py:1486-1497); NeMo's data pipeline, draft-"
        "vocab selection and sampler (shuffle_seed 42) are not used",
        "padding: the cut row is padded to 1024 tokens (pad id, attention/loss mask 0, aux states "
        "0) as padding='max_length' pads; the target's aux states at pad tokens are not in the "
        "cache, and no real position reads a padded one (causal, and the TTT steps attend to "
        "their own position only)",
        "draft config: from the cache's record of the target's config.json "
        "(feed.target_config), not AutoConfig.from_pretrained(target); the same fields set",
        "num_hidden_layers: 1 in the draft config (NeMo copies the target's 30; NeMo's draft "
        "builds one layer either way, but vLLM builds num_hidden_layers draft layers)",
        "embeddings: feed.head.embed_tokens through copy_embeddings_from_target, as the recipe's "
        "offline path hands it the cache's embeddings (train_eagle3.py:1375)",
        "schedule length: total_steps from the race (its time budget), not num_epochs x batches; "
        "training stops early at max_seconds, before the schedule ends",
        "loop: the recipe's single-rank step only (no torch.distributed, DDP, CP, TP, grad "
        "accumulation, eval, wandb or regen); a log line every ~30 s, not every 10 steps",
        "save: only the draft's weights and config (Checkpointer.save_model into out/saved); no "
        "optimizer, RNG, tokenizer or recipe state, and no epoch_E_step_S folder",
        "vLLM folder: serve_vllm.resolve_draft_artifacts writes <consolidated>/vllm_export; "
        "it is moved to out/vllm",
    ]


def _device_dtype() -> tuple[torch.device, torch.dtype]:
    """The recipe's choice: bf16 on CUDA, fp32 on CPU (train_eagle3.py:566)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def _draft_config(feed):
    """The draft config as TrainEagle3Recipe.setup builds it (train_eagle3.py:610-658)."""
    from transformers import CONFIG_MAPPING

    cfg = dict(feed.target_config)
    base = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    draft = base.to_dict()
    draft["draft_vocab_size"] = int(feed.head.selected_token_ids.numel())
    draft["target_hidden_size"] = base.hidden_size
    draft["architectures"] = ["LlamaEagle3DraftModel"]
    draft["tie_word_embeddings"] = False
    draft["attn_implementation"] = "eager"
    draft["fc_norm"] = False
    draft["norm_output"] = False
    draft["parallel_drafting"] = False
    draft["num_hidden_layers"] = 1  # an adaptation: vLLM reads it (see adaptations())
    return type(base).from_dict(draft)


def _build(feed, total_steps: int):
    """(trainer, optimizer, scheduler) as TrainEagle3Recipe.setup builds them."""
    _import_nemo()
    from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule
    from nemo_automodel.components.speculative.eagle.draft_llama import LlamaEagle3DraftModel
    from nemo_automodel.recipes.llm._spec_train_utils import make_warmup_cosine_schedule

    device, dtype = _device_dtype()
    head = feed.head
    draft = LlamaEagle3DraftModel(_draft_config(feed)).to(device=device, dtype=dtype)
    draft.copy_embeddings_from_target(SimpleNamespace(weight=head.embed_tokens))
    draft.set_vocab_mapping(head.selected_token_ids)
    draft.freeze_embeddings()
    trainer = Eagle3TrainerModule(
        draft,
        selected_token_ids=head.selected_token_ids,
        selected_token_mask=head.t2d,
        ttt_steps=TTT_STEPS,
    ).to(device)
    params = [p for p in trainer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    total_steps = max(1, int(total_steps))
    warmup_steps = max(1, int(WARMUP_RATIO * total_steps))
    schedule = make_warmup_cosine_schedule(warmup_steps, total_steps, MIN_LR_RATIO)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return trainer, optimizer, scheduler


def _inputs(batch, pad_id: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Eagle3TrainerModule.forward's offline-cache inputs for one Feed row (as
    train_eagle3.py:1486-1497 passes a cached batch)."""
    T = batch.input_ids.shape[1]
    pad = ROWS[1] - T if PAD_ROWS else 0

    def padded(t: torch.Tensor, value=0) -> torch.Tensor:  # [1, T, ...] -> [1, T + pad, ...]
        if pad <= 0:
            return t
        tail = torch.full((1, pad, *t.shape[2:]), value, dtype=t.dtype)
        return torch.cat((t, tail), dim=1)

    return dict(
        input_ids=padded(batch.input_ids, pad_id).to(device),
        attention_mask=padded(batch.attention_mask).to(device),
        loss_mask=padded(batch.loss_mask).to(device),
        aux_hidden_states=padded(batch.aux_hidden).to(device, dtype),  # [1, T, 3H]
        target_probs=padded(batch.target_p).to(device),  # [1, T, Vd] fp32, as NeMo keeps it
        position_mask=padded(batch.position_mask.bool())[..., None].to(device),  # [1, T, 1]
    )


def _step(trainer, optimizer, scheduler, inputs: dict) -> torch.Tensor:
    """One optimizer step as the recipe takes it (train_eagle3.py:2046-2081); the loss, detached."""
    metrics = trainer(**inputs)
    metrics.loss.backward()
    torch.nn.utils.clip_grad_norm_(trainer.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return metrics.loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad_id(feed) -> int:
    pad = feed.target_config.get("pad_token_id")
    return int(pad if pad is not None else 0)


def step_seconds(feed, steps: int = 6, seed: int = 0) -> float:
    """Median seconds per optimizer step after 2 warm-up steps (nothing saved); a step counts the
    row's read, as train() does."""
    torch.manual_seed(seed)
    trainer, optimizer, scheduler = _build(feed, steps + 2)
    device, dtype = _device_dtype()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        inputs = _inputs(feed.batch(i), _pad_id(feed), device, dtype)
        _step(trainer, optimizer, scheduler, inputs)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def train(
    feed, out: Path, total_steps: int, max_seconds: float | None, seed: int, log=print
) -> dict:
    """Train NeMo's draft on rows feed.batch(0..total_steps-1), save it with NeMo's checkpointer and
    export it for vLLM with NeMo's converter (see the module docstring)."""
    torch.manual_seed(seed)
    out = Path(out)
    trainer, optimizer, scheduler = _build(feed, total_steps)
    device, dtype = _device_dtype()
    steps = tokens = 0
    seconds = last_log = 0.0
    losses = []
    for i in range(total_steps):
        if max_seconds is not None and seconds >= max_seconds:
            break
        t0 = time.perf_counter()  # training time: the row's read and the step
        loss = _step(
            trainer, optimizer, scheduler, _inputs(feed.batch(i), _pad_id(feed), device, dtype)
        )
        _sync(device)
        seconds += time.perf_counter() - t0
        steps += 1
        tokens += feed.row_tokens_of(i)
        if steps == 1 or seconds - last_log >= LOG_EVERY_S or steps == total_steps:
            last_log = seconds
            losses.append(float(loss))
            lr = scheduler.get_last_lr()[0]
            log(
                f"{NAME} step {steps}/{total_steps} loss {losses[-1]:.4f} lr {lr:.2e} "
                f"{tokens / seconds:.0f} tok/s"
            )
    folder = _save(trainer.draft_model, out, feed)
    return {
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "folder": str(folder),
        "num_speculative_tokens": None,  # NeMo's EAGLE-3 config carries none (serve_vllm.py:459)
        "losses": losses,
    }


def _save(draft, out: Path, feed) -> Path:
    """NeMo's save (Checkpointer.save_model, as train_eagle3.py:1558-1590 configures it) into
    out/saved, then its vLLM export, moved to out/vllm. Returns out/vllm."""
    from huggingface_hub import constants as hf_constants
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.components.speculative.serve_vllm import resolve_draft_artifacts

    saved, vllm = out / "saved", out / "vllm"
    config = CheckpointingConfig(
        enabled=True,
        checkpoint_dir=str(out),
        model_save_format="safetensors",
        model_repo_id=str(feed.target),
        model_cache_dir=hf_constants.HF_HUB_CACHE,
        save_consolidated=True,
        is_peft=False,
        model_state_dict_keys=list(draft.state_dict().keys()),
    )
    checkpointer = config.build(dp_rank=0, tp_rank=0, pp_rank=0, moe_mesh=None)
    checkpointer.save_model(draft, str(saved), is_final_checkpoint=True)
    checkpointer.close()
    export, _ = resolve_draft_artifacts(str(saved))
    shutil.rmtree(vllm, ignore_errors=True)
    shutil.move(export, vllm)
    return vllm
