"""Synthetic draft checkpoints for the export tests: a tiny Eagle3Draft with random weights (scaled so
its predictions are decided, not ties), a vocab map, and the run files export reads; and the helpers
that read an export back or damage a copy of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spec_cli.artifacts.checkpoint import frozen_fingerprint, save_checkpoint, save_frozen
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.export.check import find_problems
from spec_cli.export.source import load_source

V, VD, H, HT, N = (
    300,
    40,
    32,
    48,
    8,
)  # target vocab, draft vocab, draft hidden, target hidden, target layers
FORMATS = ["vllm", "sglang", "speculators"]


def draft_config(**overrides) -> DraftConfig:
    values = dict(
        vocab_size=V,
        target_hidden_size=HT,
        aux_layer_ids=[1, 3, 4],
        target_num_layers=N,
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        draft_vocab_size=VD,
        target_architecture="LlamaForCausalLM",
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        target_fingerprint="t" * 16,
        tokenizer_fingerprint="k" * 16,
        vocab_map_fingerprint="v" * 16,
    )
    values.update(overrides)
    return DraftConfig(**values)


def selected_ids(seed: int = 0, size: int = VD) -> torch.Tensor:
    """`size` random target ids, ascending (size V: all of them)."""
    return torch.sort(
        torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:size]
    ).values


def make_run(
    root: Path, seed: int = 0, ttt_steps: int = 2, frozen_in_run: bool = True, **overrides
) -> Path:
    """A run folder with one checkpoint (step 5), run.json and a log.jsonl with an eval record. As
    `spec train` writes it, the frozen embedding is in the run's frozen.safetensors (bf16, as a bf16
    target holds it), not in the checkpoint; frozen_in_run=False: the older layout, all in the checkpoint."""
    config = draft_config(**overrides)
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for _, p in draft.named_parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        draft.embed_tokens.weight.copy_(draft.embed_tokens.weight.bfloat16())
    draft.set_vocab_map(selected_ids(seed, config.draft_vocab_size))
    state, frozen = draft.state_dict(), None
    if frozen_in_run:
        tensors = {"embed_tokens.weight": state.pop("embed_tokens.weight").bfloat16()}
        frozen = {"keys": sorted(tensors), "fingerprint": frozen_fingerprint(tensors)}
        root.mkdir(parents=True, exist_ok=True)
        save_frozen(root, tensors, frozen["fingerprint"], {})
    save_checkpoint(
        root,
        5,
        state,
        {},
        {"torch_cpu": torch.get_rng_state()},
        config.to_dict(),
        {"step": 5},
        frozen=frozen,
    )
    (root / "run.json").write_text(
        json.dumps({"options": {"target": "/models/tiny-llama", "ttt_steps": ttt_steps}})
    )
    records = [
        {"split": "eval", "step": 3, "acc": [0.4, 0.2], "acceptance_length": 1.48, "loss": 2.0},
        {"split": "eval", "step": 5, "acc": [0.5, 0.3], "acceptance_length": 1.65, "loss": 1.0},
        {"split": "eval", "step": 9, "acc": [0.9, 0.9], "acceptance_length": 2.71, "loss": 0.1},
    ]
    (root / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


# ----------------------------------------------------------------------------- reading an export back


def read(folder: Path) -> tuple[dict, dict]:
    return json.loads((folder / "config.json").read_text()), load_file(
        str(folder / "model.safetensors")
    )


def tampered(folder: Path, tmp_path: Path, tensors_fn=None, config_fn=None) -> Path:
    copy = tmp_path / "tampered"
    shutil.copytree(folder, copy)
    config, tensors = read(copy)
    if tensors_fn:
        tensors_fn(tensors)
        save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    if config_fn:
        config_fn(config)
        (copy / "config.json").write_text(json.dumps(config))
    return copy


def problems_of(folder, fmt, run_dir):
    problems, _ = find_problems(folder, fmt, load_source(run_dir), torch.bfloat16)
    return " | ".join(problems)
