"""`spec eval`: real speculative decoding of the target with a draft, on MT-bench or chat prompts.

For every user turn the speculative decoder and the target alone (plain decoding with its KV cache)
answer the same prompt, one after the other, so machine load hits both alike. Turn j of a conversation
is asked after the speculative decoder's own answer to turn j-1 (under greedy it is also the target's).
Written to --output: eval.json (settings, overall and per-category numbers), outputs.jsonl (each
answer and its acceptance) and acceptance.png (acceptance rate by draft position).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spec_cli import __version__, assets
from spec_cli.artifacts.io import SCHEMA_VERSION, atomic_path, write_json
from spec_cli.console import info, progress
from spec_cli.errors import ConfigError
from spec_cli.eval import drafts, prompts
from spec_cli.eval.report import Tally, plot_acceptance
from spec_cli.eval.speculative import Settings, generate, generate_target
from spec_cli.eval.target import TREE_ATTENTION, Target
from spec_cli.target import loading

WARMUP_TOKENS = 8  # one untimed generation of each decoder first (allocator, kernels, lazy init)


@dataclass
class EvalConfig:
    target: str
    draft: Path  # run folder, checkpoint folder or export folder
    prompts: str = "mt-bench"  # `mt-bench` or a chat data file
    output: Path | None = None  # default: beside the draft (see default_output)
    depth: int = 3  # draft tokens per verification (tree: depth)
    topk: int = 1  # 1: chain; > 1: EAGLE-2 tree
    num_tokens: int | None = None  # tree nodes verified per step (default 16, at most all candidates)
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int = 256
    num_prompts: int | None = None  # default: all
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    check_fingerprint: bool = True


@dataclass
class EvalResult:
    output: Path
    json_path: Path
    plot_path: Path
    outputs_path: Path
    draft: str
    target_name: str
    settings: dict
    overall: dict
    categories: dict
    seconds: float


def tree_size(depth: int, topk: int, num_tokens: int | None) -> int:
    """Nodes a tree verifies: --num-tokens (default 16), at most the k + (depth-1)*k^2 candidates."""
    candidates = topk + (depth - 1) * topk * topk
    return min(num_tokens or 16, candidates)


def default_output(draft: drafts.LoadedDraft) -> Path:
    """Beside the draft: RUN/eval/step-N for a checkpoint of a run, EXPORT-eval for an export (the export
    folder stays exactly what the engine loads)."""
    if draft.kind == "export":
        return draft.path.parent / f"{draft.path.name}-eval"
    if draft.run_dir is not None:
        return draft.run_dir / "eval" / draft.path.name
    return draft.path / "eval"


def _validate(cfg: EvalConfig) -> None:
    if cfg.depth < 1 or cfg.topk < 1 or cfg.max_new_tokens < 1:
        raise ConfigError("--depth, --topk and --max-new-tokens must be at least 1",
                          "e.g. --depth 3 --topk 1")
    if cfg.temperature < 0:
        raise ConfigError(f"--temperature {cfg.temperature} is negative", "use 0 (greedy) or more")
    if cfg.num_tokens is not None and cfg.topk == 1:
        raise ConfigError("--num-tokens sizes a tree (--topk 2 or more); a chain verifies --depth tokens",
                          "drop --num-tokens, or add --topk")
    if cfg.num_tokens is not None and cfg.num_tokens < 1:
        raise ConfigError("--num-tokens must be at least 1", "e.g. --num-tokens 16")


def _eos_ids(tokenizer, model) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return frozenset(int(i) for i in ids if i is not None)


def run(cfg: EvalConfig) -> EvalResult:
    start = time.perf_counter()
    _validate(cfg)
    target_dir = loading.resolve_target(assets.resolve_target_arg(cfg.target))
    target_config = loading.load_config(target_dir)
    tokenizer = loading.load_tokenizer(target_dir)
    loaded = drafts.load_draft(Path(cfg.draft), target_config)
    drafts.check_target(loaded, target_dir, target_config, tokenizer, cfg.check_fingerprint)
    c = loaded.model.config
    if cfg.topk > c.draft_vocab_size:
        raise ConfigError(f"--topk {cfg.topk} exceeds the draft vocabulary ({c.draft_vocab_size})",
                          "use a smaller --topk")
    conversations = prompts.load_conversations(cfg.prompts, cfg.num_prompts)
    output = Path(cfg.output) if cfg.output else default_output(loaded)

    device = loading.choose_device(cfg.device)
    dtype = loading.choose_dtype(cfg.dtype, device)
    info(f"loading {target_dir.name} ({str(dtype).replace('torch.', '')} on {device}) and the draft "
         f"{loaded.describe()}")
    model = loading.load_model(target_dir, device, dtype)
    draft = loaded.model
    if loaded.needs_embeddings:  # engines share the target's table with the draft
        draft.copy_embeddings(model.get_input_embeddings().weight.float().cpu())
    draft.to(device=device, dtype=dtype).eval()
    target = Target(model, c.aux_layer_ids)
    if cfg.topk > 1 and target.attn_implementation not in TREE_ATTENTION:
        raise ConfigError(f"tree verification needs sdpa or eager attention; the target uses "
                          f"{target.attn_implementation}", "use a chain (--topk 1)")
    nodes = tree_size(cfg.depth, cfg.topk, cfg.num_tokens) if cfg.topk > 1 else cfg.depth
    settings = Settings(depth=cfg.depth, topk=cfg.topk, num_tokens=nodes,
                        temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                        eos_ids=_eos_ids(tokenizer, model))

    seeds = _Seeds(cfg.seed, device) if cfg.temperature > 0 else None
    warm = replace(settings, max_new_tokens=min(WARMUP_TOKENS, cfg.max_new_tokens))
    first = prompts.prompt_ids(tokenizer, conversations[0], 0)
    generate(target, draft, first, warm, seeds and seeds(0, 0, 0))
    generate_target(target, first, warm, seeds and seeds(0, 0, 1))
    overall, categories, records = decode_all(target, draft, tokenizer, conversations, settings, seeds)
    target.close()

    settings_json = {"depth": cfg.depth, "topk": cfg.topk, "num_tokens": settings.num_tokens,
                     "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                     "prompts": cfg.prompts, "num_prompts": len(conversations),
                     "turns": sum(len(conv.turns) for conv in conversations), "seed": cfg.seed,
                     "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                     "eos_ids": sorted(settings.eos_ids)}
    overall_m = overall.metrics()
    category_m = {name: t.metrics() for name, t in categories.items()}
    output.mkdir(parents=True, exist_ok=True)
    json_path, outputs_path = output / "eval.json", output / "outputs.jsonl"
    plot_path = output / "acceptance.png"
    write_json(json_path, {
        "kind": "eval", "schema_version": SCHEMA_VERSION, "version": __version__,
        "target": str(target_dir), "draft": {"path": str(loaded.path), "kind": loaded.kind,
                                             "format": loaded.format, "step": loaded.step,
                                             "aux_layer_outputs": list(c.aux_layer_ids)},
        "settings": settings_json, "overall": overall_m, "categories": category_m,
    })
    with atomic_path(outputs_path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    shape = f"chain {cfg.depth}" if cfg.topk == 1 else f"tree {cfg.depth}x{cfg.topk}/{settings.num_tokens}"
    plot_acceptance(plot_path, overall_m, category_m,
                    f"{loaded.path.name} on {target_dir.name} ({shape}): acceptance length "
                    f"{overall_m['acceptance_length']:.2f}, speed-up {overall_m['speedup']:.2f}x")
    return EvalResult(output=output, json_path=json_path, plot_path=plot_path, outputs_path=outputs_path,
                      draft=loaded.describe(), target_name=target_dir.name, settings=settings_json,
                      overall=overall_m, categories=category_m, seconds=time.perf_counter() - start)


def decode_all(target: Target, draft, tokenizer, conversations: list[prompts.Conversation],
               settings: Settings, seeds: _Seeds | None):
    """Every turn of every conversation, speculative then target alone on the same prompt; turn j is
    asked after the speculative decoder's answer to turn j-1. -> (overall, per-category Tally, records)."""
    overall, categories, records = Tally(settings.depth), {}, []
    with progress("eval", sum(len(conv.turns) for conv in conversations)) as bar:
        for i, conv in enumerate(conversations):
            for turn in range(len(conv.turns)):
                ids = prompts.prompt_ids(tokenizer, conv, turn)
                spec = generate(target, draft, ids, settings, seeds and seeds(i, turn, 0))
                base = generate_target(target, ids, settings, seeds and seeds(i, turn, 1))
                overall.add(spec, base)
                if conv.category:
                    categories.setdefault(conv.category, Tally(settings.depth)).add(spec, base)
                answer = tokenizer.decode(spec.tokens, skip_special_tokens=True).strip()
                conv.answers.append(answer)
                records.append({"id": conv.id, "category": conv.category, "turn": turn,
                                "prompt_tokens": len(ids), "tokens": len(spec.tokens),
                                "acceptance_length": round(spec.acceptance_length, 4),
                                "same_as_target": spec.tokens == base.tokens, "answer": answer})
                bar.advance()
    return overall, categories, records


class _Seeds:
    """A seeded generator per (conversation, turn, decoder): sampling runs are reproducible."""

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.device = seed, device

    def __call__(self, *key: int) -> torch.Generator:
        seed = self.seed
        for k in key:
            seed = (seed * 1_000_003 + k) % (2 ** 63)
        return torch.Generator(device=self.device).manual_seed(seed)
