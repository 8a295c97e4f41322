"""The target engine: what runs an in-process target (`--target-engine transformers|vllm`;
docs/glossary.md).

Both give the same supervision (tests/target/test_vllm_backend.py measures how close), so nothing an
artifact is identified by (target, tokenizer, vocab map, aux layers, dtype) depends on the target
engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_cli import distributed
from spec_cli.errors import ConfigError

ENGINES = ("transformers", "vllm")


def check_engine(name: str) -> str:
    """Fail early (before tokenising or loading anything) on an unknown or uninstalled engine."""
    if name not in ENGINES:
        raise ConfigError(f"unknown --target-engine {name!r}", f"use one of {', '.join(ENGINES)}")
    if name == "vllm":
        from spec_cli.engine import vllm as engine

        engine.require("--target-engine vllm")
        if distributed.world_size() > 1:
            raise ConfigError("--target-engine vllm runs one engine in this process; it does not run "
                              "under torchrun", "run without torchrun, or use --target-engine transformers")
    return name


def open_backend(name: str, target_dir: Path, aux_layers: list[int] | str | None,
                 device: torch.device | str | None, dtype: torch.dtype | str | None, chat_template=None):
    """The target loaded by target engine `name` (a LocalTargetBackend). `chat_template` (--chat-template, a
    data.chat_templates.ChatTemplate) is the template its data is tokenised with: it enters the
    tokenizer fingerprint the backend reports."""
    check_engine(name)
    if name == "vllm":
        from spec_cli.target.vllm_backend import VLLMTargetBackend

        backend = VLLMTargetBackend(target_dir, aux_layers, device, dtype)
    else:
        from spec_cli.target.hf_backend import HFTargetBackend

        backend = HFTargetBackend(target_dir, aux_layers, device, dtype)
    if chat_template is not None:
        from spec_cli.target import loading

        tokenizer = loading.load_tokenizer(target_dir)
        tokenizer.chat_template = chat_template.text
        backend.info["tokenizer_fingerprint"] = loading.tokenizer_fingerprint(tokenizer)
        backend.info["chat_template_source"] = chat_template.source  # provenance (a server reports it)
    return backend
