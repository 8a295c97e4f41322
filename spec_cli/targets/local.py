"""The target engine: what runs an in-process target (`--target-engine transformers|vllm`;
docs/glossary.md).

Both give the same supervision (tests/targets/test_vllm_backend.py measures how close), so nothing an
artifact is identified by (target, tokenizer, vocab map, aux layers, dtype) depends on the target
engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_cli import distributed, threads
from spec_cli.console import info
from spec_cli.errors import ConfigError
from spec_cli.targets import loading

ENGINES = ("transformers", "vllm")


def check_engine(name: str) -> str:
    """Fail early (before tokenising or loading anything) on an unknown or uninstalled engine."""
    if name not in ENGINES:
        raise ConfigError(f"unknown --target-engine {name!r}", f"use one of {', '.join(ENGINES)}")
    if name == "vllm":
        from spec_cli.engine import vllm as engine

        engine.require("--target-engine vllm")
        if distributed.world_size() > 1:
            raise ConfigError(
                "--target-engine vllm runs one engine in this process; it does not run "
                "under torchrun",
                "run without torchrun, or use --target-engine transformers",
            )
    return name


PARALLEL = ("auto", "replica", "tensor")  # --target-parallel
AUTO_SHARE = 0.5  # auto: shard a target whose weights take more than this share of one GPU


def tensor_parallel(
    choice: str, name: str, target_dir: Path, device: torch.device
) -> tuple[bool, str]:
    """--target-parallel: (shard the live target over this machine's ranks?, why), under torchrun.
    A target that fits one GPU with room for the draft stays a replica per rank: no communication in
    its forward. One that does not is sharded (`auto` decides by its weights' size against the GPU)."""
    if choice not in PARALLEL:
        raise ConfigError(
            f"unknown --target-parallel {choice!r}", f"use one of {', '.join(PARALLEL)}"
        )
    if distributed.world_size() == 1 or choice == "replica":
        return (
            False,
            "one process" if distributed.world_size() == 1 else "--target-parallel replica",
        )
    if choice == "auto":
        if device.type != "cuda":
            return False, "auto: a replica per rank off GPUs"
        weights, gpu = (
            loading.weights_bytes(target_dir),
            torch.cuda.get_device_properties(device).total_memory,
        )
        if weights <= AUTO_SHARE * gpu:
            return False, (
                f"auto: its weights ({weights / 2**30:.1f} GiB) fit in {AUTO_SHARE:.0%} of a GPU "
                f"({gpu / 2**30:.0f} GiB)"
            )
        why = f"auto: its weights ({weights / 2**30:.1f} GiB) take over {AUTO_SHARE:.0%} of a GPU ({gpu / 2**30:.0f} GiB)"
    else:
        why = "--target-parallel tensor"
    if name != "transformers":
        raise ConfigError(
            f"a target sharded over ranks runs in transformers ({why}); --target-engine {name} "
            "runs one engine per process",
            "use --target-engine transformers, or serve the target",
        )
    return True, why


def open_backend(
    name: str,
    target_dir: Path,
    aux_layers: list[int] | str | None,
    device: torch.device | str | None,
    dtype: torch.dtype | str | None,
    chat_template=None,
    parallel: str = "replica",
    memory: float | None = None,
    vllm_tensor_parallel: int = 1,
):
    """The target loaded by target engine `name` (a LocalTargetBackend). `chat_template` (--chat-template, a
    data.chat_templates.ChatTemplate) is the template its data is tokenised with: it enters the
    tokenizer fingerprint the backend reports. `parallel`: --target-parallel (torchrun); `memory`:
    --target-memory (vLLM's share of the GPU); `vllm_tensor_parallel`: --target-tensor-parallel (vLLM's
    workers)."""
    check_engine(name)
    if vllm_tensor_parallel > 1 and name != "vllm":
        raise ConfigError(
            f"--target-tensor-parallel is vLLM's (--target-engine vllm), not {name}'s",
            "with transformers, shard the target over torchrun's ranks: --target-parallel tensor",
        )
    if name == "vllm":
        from spec_cli.targets.vllm_backend import VLLMTargetBackend

        backend = VLLMTargetBackend(
            target_dir,
            aux_layers,
            device,
            dtype,
            memory=memory,
            tensor_parallel=vllm_tensor_parallel,
        )
    else:
        from spec_cli.targets.hf_backend import HFTargetBackend

        device = device if isinstance(device, torch.device) else loading.choose_device(device)
        sharded, why = tensor_parallel(parallel, name, target_dir, device)
        if sharded:
            info(f"target: sharded over this machine's {threads.ranks_here()} ranks ({why})")
        backend = HFTargetBackend(
            target_dir,
            aux_layers,
            device,
            dtype,
            mesh=distributed.machine_mesh(device) if sharded else None,
        )
    if chat_template is not None:
        tokenizer = loading.load_tokenizer(target_dir)
        tokenizer.chat_template = chat_template.text
        backend.info["tokenizer_fingerprint"] = loading.tokenizer_fingerprint(tokenizer)
        backend.info["chat_template_source"] = (
            chat_template.source
        )  # provenance (a server reports it)
    return backend


def check_reads_input_embeds(engine: str, algorithm, what: str) -> None:
    """ConfigError (before any model loads) when `algorithm` reads the target's input embeddings (MSD)
    and the target runs in an engine whose backend does not capture them (vLLM)."""
    from spec_cli.draft.algorithm import INPUT_EMBEDS

    if engine != "transformers" and INPUT_EMBEDS in algorithm.needs:
        raise ConfigError(
            f"{algorithm.title} reads the target's input embeddings (its first layer's input), which "
            f"the {engine} target backend does not capture",
            f"{what} with --target-engine transformers",
        )
