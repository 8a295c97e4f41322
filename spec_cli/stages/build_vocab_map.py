"""`spec build-vocab-map`: count supervised target tokens and choose the draft vocabulary."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli import assets
from spec_cli.artifacts import outputs
from spec_cli.artifacts.tokens import TokenizedData
from spec_cli.artifacts.vocab_map import VocabMap, build_vocab_map, load_vocab_map, save_vocab_map
from spec_cli.console import progress
from spec_cli.data import chat_templates
from spec_cli.data.tokenize import tokenize_data
from spec_cli.errors import ArtifactError, ConfigError, SpecError
from spec_cli.targets.loading import (
    load_config,
    load_tokenizer,
    processor_loader,
    resolve_target,
    tokenizer_fingerprint,
    vocab_size,
)

COUNT_CHUNK = 1 << 24  # tokens per bincount call


@dataclass
class BuildVocabMapConfig:
    target: str
    data: str
    output: Path
    draft_vocab_size: int = 32000
    max_length: int = 2048
    num_proc: int = 1
    chat_template: str | None = None  # a Jinja file or a family name; None: the target's own
    force: bool = False  # replace a vocab map at -o made from other inputs


@dataclass
class BuildVocabMapResult:
    vocab_map: VocabMap
    tokens: TokenizedData
    output: Path
    seconds: float


def count_supervised(tokens: TokenizedData, vocab_size: int) -> torch.Tensor:
    """[V] int64 counts of target ids at loss_mask == 1, by vectorised bincount over chunks."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    n = tokens.num_tokens
    with progress("counting", total=n, unit="tokens") as bar:
        for start in range(0, n, COUNT_CHUNK):
            ids = tokens.input_ids[start : start + COUNT_CHUNK].long()
            mask = tokens.loss_mask[start : start + COUNT_CHUNK].bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)
            bar.advance(ids.numel())
    return counts


# What must be equal for an existing vocab map at -o to be rewritten without --force.
SAME_INPUTS = ("tokenizer_fingerprint", "data_fingerprint", "max_length", "draft_vocab_size")


def _existing(output: Path, force: bool) -> dict | None:
    """The metadata of the vocab map at -o (rewritten only when made from the same inputs), None when -o
    is free or --force; refuses a folder, or a file that is not a vocab map, up front."""
    output = Path(output)
    if force or not output.exists():
        return None
    try:
        return dict(load_vocab_map(output).metadata)
    except SpecError:  # (outputs.check let it through as a vocab map: damaged since)
        raise ArtifactError(
            f"{output} already exists and is not a readable vocab map",
            "pass another -o, or --force to replace it",
        ) from None


def _check_same(output: Path, old: dict, new: dict) -> None:
    differs = [k for k in SAME_INPUTS if old.get(k) != new.get(k)]
    if differs:
        raise ArtifactError(
            f"{output} already holds a vocab map made from other inputs ({', '.join(differs)} "
            "differ)",
            "pass another -o, or --force to replace it",
        )


def run(cfg: BuildVocabMapConfig) -> BuildVocabMapResult:
    start = time.perf_counter()
    outputs.check(
        {"-o": (cfg.output, outputs.VOCAB_MAP)},
        {"--target": cfg.target, "--data": cfg.data, "--chat-template": cfg.chat_template},
        replace_flag="--force",
    )
    old = _existing(cfg.output, cfg.force)
    target_dir = resolve_target(assets.resolve_target_arg(cfg.target))
    data_path = Path(assets.resolve_data_arg(cfg.data))
    template = chat_templates.resolve(cfg.chat_template)
    tokenizer = load_tokenizer(target_dir, template)
    v = vocab_size(load_config(target_dir), tokenizer)
    if cfg.draft_vocab_size > v:  # fail before tokenising anything
        raise ConfigError(
            f"--draft-vocab-size {cfg.draft_vocab_size} is larger than the target vocab ({v})",
            f"use at most {v}",
        )
    tok_fp = tokenizer_fingerprint(tokenizer)
    tokens = tokenize_data(
        data_path,
        tokenizer,
        tok_fp,
        cfg.max_length,
        cfg.num_proc,
        load_processor=processor_loader(target_dir),
    )  # image-text records: their answers count
    counts = count_supervised(tokens, v)
    vocab_map = build_vocab_map(
        counts,
        cfg.draft_vocab_size,
        {
            "tokenizer_fingerprint": tok_fp,
            **chat_templates.identity(tokenizer, template),
            "target": str(target_dir),
            "data": str(data_path),
            "data_fingerprint": tokens.metadata["data_fingerprint"],
            "max_length": cfg.max_length,
            "num_samples": len(tokens),
        },
    )
    if old is not None:
        _check_same(
            cfg.output, old, {**vocab_map.metadata, "draft_vocab_size": cfg.draft_vocab_size}
        )
    save_vocab_map(vocab_map, cfg.output)
    return BuildVocabMapResult(vocab_map, tokens, cfg.output, time.perf_counter() - start)
