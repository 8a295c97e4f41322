"""`spec precompute`: run the target over the tokenised data and write the feature cache.

Work is planned up front (length-bucketed batches grouped into shards by token count), so shard i
always holds the same batches: an interrupted run skips its verified shards and writes the rest, a
rerun of a finished cache checks each shard against the manifest's checksum and recomputes a damaged
one, and ranks under torchrun take shards i % world_size == rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli import assets, distributed, threads
from spec_cli.artifacts import feature_cache as fc
from spec_cli.artifacts import guard, outputs
from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.batch import EXTRA
from spec_cli.console import human_bytes, info, progress, warn
from spec_cli.data import chat_templates
from spec_cli.data.batching import collate, padding_fraction, plan_by_source
from spec_cli.data.tokenize import tokenize_data, tokenize_seconds_bound
from spec_cli.draft import algorithms
from spec_cli.draft.algorithm import FINAL_HIDDEN
from spec_cli.errors import ArtifactError, ConfigError
from spec_cli.targets import loading, local
from spec_cli.targets.backend import require_images

_TEST_SHARD_DELAY = float(os.environ.get("SPEC_TEST_SHARD_DELAY", "0") or 0)


@dataclass
class PrecomputeConfig:
    target: str
    data: str
    vocab_map: Path
    output: Path
    encoding: str = "hidden"
    algorithm: str = "eagle3"  # the draft algorithm the cache is for: it decides the aux layers
    aux_layers: str | None = None
    batch_tokens: int = 8192
    shard_tokens: int = 65536
    max_length: int = 2048
    max_samples: int | None = None
    num_proc: int = 1
    device: str | None = None
    dtype: str | None = None
    storage_dtype: str | None = (
        None  # bf16 | fp16 | fp32: the float features on disk; None: the model dtype
    )
    resume: bool = True
    target_engine: str = "transformers"  # or vllm: the same cache (identity), another target engine
    target_memory: float | None = None  # vLLM's share of the GPU (None: vLLM's default)
    target_parallel: str = (
        "auto"  # torchrun: replica | tensor (sharded over a machine's ranks) | auto
    )
    target_tensor_parallel: int = 1  # --target-engine vllm: vLLM's tensor_parallel_size
    threads: int | None = None  # intra-op threads; None: auto (spec_cli.threads.choose)
    chat_template: str | None = None  # a Jinja file or a family name; None: the target's own


@dataclass
class PrecomputeResult:
    manifest: dict
    output: Path
    seconds: float
    computed_shards: int
    reused_shards: int
    estimated_bytes: int  # everything the cache folder holds when done: shards, head, manifest
    padding: float
    compute_seconds: float = 0.0
    computed_tokens: int = 0
    # how the tokens/s were measured (not in the manifest, which a resumed or torchrun run must
    # reproduce byte for byte): threads, why, and spec_cli.threads.Meter's "busy" record
    threads: int = 0
    threads_reason: str = ""
    busy: dict | None = None
    disk: dict | None = None  # feature_cache.folder_bytes of the finished folder (rank 0)


def plan_shards(
    batches: list[list[int]], lengths: torch.Tensor, shard_tokens: int
) -> list[list[int]]:
    """Consecutive batch indices grouped until a shard holds >= shard_tokens real tokens."""
    shards, current, tokens = [], [], 0
    for i, batch in enumerate(batches):
        current.append(i)
        tokens += int(lengths[batch].sum())
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


def _check_disk(folder: Path, needed: dict[str, int], storage: torch.dtype) -> None:
    """`needed`: bytes still to write by part (shards, head, manifest)."""
    free = shutil.disk_usage(folder).free
    total = sum(needed.values())
    if total > free:
        parts = ", ".join(f"{name} {human_bytes(n)}" for name, n in needed.items() if n)
        smaller = (
            ", or --storage-dtype bf16 (half the bytes of fp32 features)"
            if storage == torch.float32
            else ""
        )
        raise ArtifactError(
            f"the cache needs about {human_bytes(total)} more ({parts}) but {folder} has "
            f"{human_bytes(free)} free",
            f"free disk space, use fewer samples (--max-samples) or a smaller --max-length{smaller}",
        )


def _storage_dtype(option: str | None, model_dtype: torch.dtype) -> torch.dtype:
    if option in (None, "", "auto"):
        return model_dtype
    if option not in loading.DTYPES:
        raise ConfigError(
            f"unknown --storage-dtype {option!r}",
            f"use one of {', '.join(loading.DTYPES)}, or leave it out to store the model dtype",
        )
    return loading.DTYPES[option]


def run(cfg: PrecomputeConfig, target=None) -> PrecomputeResult:
    """`target`: a LocalTargetBackend already open (spec regenerate --features hands its own, which
    reads kept states back), used in place of opening cfg.target_engine's; its owner closes it."""
    if distributed.rank() == 0:  # before any work (the ranks write one folder)
        outputs.check(
            {"-o": (cfg.output, outputs.FEATURE_CACHE)},
            {
                "--target": cfg.target,
                "--data": cfg.data,
                "--vocab-map": cfg.vocab_map,
                "--chat-template": cfg.chat_template,
            },
            replace_flag="--no-resume",
        )
    with (
        contextlib.ExitStack() as lock
    ):  # the output folder's lock (rank 0), taken once the inputs are checked
        return _run(cfg, lock, target)


def _marker(out: Path) -> tuple[str]:
    """What marks `out` as a cache: its manifest, or for an interrupted run (no manifest yet) a shard or
    head it wrote (the guard then still refuses any file a cache does not write)."""
    own = sorted(fc.own_files(out))
    return (fc.MANIFEST if (out / fc.MANIFEST).exists() or not own else own[0],)


def _verified(out: Path, manifest: dict, mine: list[int]) -> dict[int, dict]:
    """This rank's shards of a finished cache whose sha256 is the manifest's, by index, with their entries.
    The others (every rank's) are named in one warning; the caller recomputes them."""
    entries = {e["shard"]: e for e in manifest.get("shards", [])}
    verified = {i: entries[i] for i in mine if i in entries and fc.shard_matches(out, entries[i])}
    names = [fc.shard_name(i) for i in mine if i not in verified]
    damaged = sorted(name for part in distributed.gather_to_main(names) or [] for name in part)
    if damaged:
        more = f" (+{len(damaged) - 3} more)" if len(damaged) > 3 else ""
        warn(
            f"feature cache {out}: {', '.join(damaged[:3])}{more} "
            f"{'fails its checksum' if len(damaged) == 1 else 'fail their checksums'}: "
            f"recomputing {'it' if len(damaged) == 1 else 'them'}"
        )
    return verified


def _run(cfg: PrecomputeConfig, lock: contextlib.ExitStack, target=None) -> PrecomputeResult:
    start = time.perf_counter()
    if cfg.encoding not in fc.ENCODINGS:
        raise ConfigError(
            f"unknown --encoding {cfg.encoding!r}", f"use one of {', '.join(fc.ENCODINGS)}"
        )
    device = distributed.local_device(loading.choose_device(cfg.device))
    dtype = loading.choose_dtype(cfg.dtype, device)
    storage = _storage_dtype(cfg.storage_dtype, dtype)
    distributed.init(device)
    rank, world = distributed.rank(), distributed.world_size()
    if rank == 0 and (hint := loading.bf16_hint(cfg.dtype, device)):
        info(hint)

    # ---- everything that can fail cheaply fails before the model loads
    local.check_engine(cfg.target_engine)
    target_dir = loading.resolve_target(assets.resolve_target_arg(cfg.target))
    config = loading.load_config(target_dir)
    n_layers = loading.num_layers(config)
    aux_layers = loading.parse_aux_layers(cfg.aux_layers, n_layers, cfg.algorithm)
    template = chat_templates.resolve(cfg.chat_template)
    tokenizer = loading.load_tokenizer(target_dir, template)
    vocab_map = load_vocab_map(cfg.vocab_map)
    tok_fp = loading.check_tokenizer(
        vocab_map.metadata,
        tokenizer,
        template,
        f"the vocab map {cfg.vocab_map}",
        "rebuild it with `spec build-vocab-map --target` this target",
    )
    if vocab_map.target_vocab_size != loading.vocab_size(config, tokenizer):
        raise ArtifactError(
            f"the vocab map covers {vocab_map.target_vocab_size} target ids, the target "
            f"has {loading.vocab_size(config, tokenizer)}",
            "rebuild the vocab map",
        )
    data_path = Path(assets.resolve_data_arg(cfg.data))
    processor = loading.processor_loader(
        target_dir
    )  # a vision-language target's, for image-text records
    if rank == 0:  # rank 0 tokenises (cached); the others then read the cache
        tokens = tokenize_data(
            data_path, tokenizer, tok_fp, cfg.max_length, cfg.num_proc, load_processor=processor
        )
    distributed.wait_for_main("tokenising the data", tokenize_seconds_bound(data_path))
    if rank != 0:
        tokens = tokenize_data(
            data_path, tokenizer, tok_fp, cfg.max_length, 1, load_processor=processor
        )
    if tokens.images is not None and cfg.target_engine != "transformers":
        raise ConfigError(
            f"image-text rows ({tokens.metadata['num_images']} images) need the target's vision "
            f"encoder, which the {cfg.target_engine} target backend does not run here",
            "precompute them with --target-engine transformers",
        )
    n_samples = len(tokens) if cfg.max_samples is None else min(cfg.max_samples, len(tokens))
    lengths = tokens.lengths[:n_samples]
    batches = plan_by_source(
        lengths, cfg.batch_tokens, tokens.num_images
    )  # image-text rows batched apart
    shards = plan_shards(batches, lengths, cfg.shard_tokens)
    hidden_size = int(getattr(config, "hidden_size", None) or config.text_config.hidden_size)
    fields = stored_fields(cfg.algorithm)
    local.check_reads_input_embeds(cfg.target_engine, algorithms.get(cfg.algorithm), "precompute")
    dtype_name = str(dtype).replace("torch.", "")
    storage_name = str(storage).replace("torch.", "")
    identity = {
        "target_fingerprint": loading.target_fingerprint(target_dir),
        "tokenizer_fingerprint": tok_fp,
        "chat_template_sha256": chat_templates.template_sha256(tokenizer.chat_template),
        "vocab_map_fingerprint": vocab_map.fingerprint,
        "aux_layers": aux_layers,
        "encoding": cfg.encoding,
        "dtype": dtype_name,
        "storage_dtype": storage_name,
        "data_fingerprint": f"{tokens.metadata['data_fingerprint']}:{n_samples}"
        + (f":images {tokens.metadata['images_fingerprint']}" if tokens.images is not None else ""),
        "max_length": cfg.max_length,
        "batch_tokens": cfg.batch_tokens,
        "shard_tokens": cfg.shard_tokens,
        **(
            {"extra_fields": {name: f.width(hidden_size) for name, f in fields.items()}}
            if fields
            else {}
        ),
    }

    out = Path(cfg.output)
    inputs = [data_path, Path(cfg.vocab_map), target_dir]
    if rank == 0:  # the ranks write one folder: rank 0 holds its lock for all of them
        if not cfg.resume:  # refuse before creating anything
            guard.check_replaceable(out, *_marker(out), "feature cache", inputs, fc.own_files(out))
        lock.enter_context(guard.FolderLock(out, "spec precompute"))
        fc.remove_temporaries(
            out
        )  # a killed run's half-written shard (no writer is alive: we hold the lock)
        if not cfg.resume:
            guard.replace_folder(out, *_marker(out), "feature cache", inputs, fc.own_files(out))
    distributed.barrier()
    out.mkdir(parents=True, exist_ok=True)
    distributed.check_shared_folder(out, "the feature cache")  # the ranks write one folder
    mine = [i for i in range(len(shards)) if i % world == rank]
    if (out / fc.MANIFEST).is_file():
        existing = fc.read_manifest(out)
        mismatch = fc.identity_mismatch(identity, existing)
        template_differs = chat_templates.mismatch(
            existing, tokenizer, template, f"the feature cache in {out}"
        )
        if mismatch and template_differs:
            raise ArtifactError(
                template_differs[0], f"{template_differs[1]} (--no-resume replaces it)"
            )
        if mismatch:
            raise ArtifactError(
                f"{out} holds a different feature cache ({mismatch})",
                "write to a new --output folder, or pass --no-resume to replace it",
            )
        fc.check_files(
            out, existing
        )  # sizes and tensor shapes: a truncated or missing shard stops here
        done = _verified(
            out, existing, mine
        )  # what is reused is checked as `spec inspect --verify` checks it
        if not distributed.max_over_ranks(len(mine) - len(done)):
            info(f"feature cache {out} is already complete")
            on_disk = fc.folder_bytes(out)
            return PrecomputeResult(
                existing,
                out,
                time.perf_counter() - start,
                0,
                len(shards),
                on_disk["total"],
                padding_fraction(lengths, batches),
                disk=on_disk,
            )
    else:  # an interrupted run: each shard against its sidecar
        done = {i: e for i in mine if (e := fc.completed_shard(out, i, identity)) is not None}
    todo = [i for i in mine if i not in done]
    per_token = fc.bytes_per_token(
        cfg.encoding,
        hidden_size,
        vocab_map.draft_vocab_size,
        storage_name,
        len(aux_layers),
        sum(f.width(hidden_size) for f in fields.values()),
    )
    todo_tokens = sum(int(lengths[batches[b]].sum()) for i in todo for b in shards[i])

    def shard_size(i: int) -> int:
        return fc.shard_bytes(
            sum(int(lengths[batches[b]].sum()) for b in shards[i]),
            sum(len(batches[b]) for b in shards[i]),
            len(shards[i]),
            per_token,
        )

    # Everything the finished folder holds: the shards, the head (embed_tokens [V, H] is most of it for
    # a large vocab: 335 MB for Gemma 3 in bf16) and the manifest. Rank 0 writes the head and manifest
    # (again on a resume: atomically, so the new file needs its room before the old one goes).
    head = fc.head_bytes(
        vocab_map.target_vocab_size, hidden_size, vocab_map.draft_vocab_size, dtype_name
    )
    estimate = {
        "shards": sum(shard_size(i) for i in range(len(shards))),
        "head": head,
        "manifest": fc.manifest_bytes(len(shards), config.to_dict()),
    }
    estimated = sum(estimate.values())
    info(
        f"feature cache: {n_samples} samples, {int(lengths.sum())} tokens, {len(batches)} batches in "
        f"{len(shards)} shards; estimated size {human_bytes(estimated)} (shards "
        f"{human_bytes(estimate['shards'])} at {per_token} bytes/token in {storage_name}, head "
        f"{human_bytes(head)}); {len(done)} shard(s) already done"
    )
    _check_disk(
        out,
        {
            "shards": sum(shard_size(i) for i in todo),
            "head": head if rank == 0 else 0,
            "manifest": estimate["manifest"] if rank == 0 else 0,
        },
        storage,
    )

    backend = None
    choice = threads.choose_for_run(cfg.threads)  # before the model loads (vLLM then sets its own)
    previous = torch.get_num_threads()
    torch.set_num_threads(choice.threads)
    # --target-parallel tensor: the machine's ranks run the target together (each layer's all-reduce spans
    # them), so each rank runs as many forwards as the busiest: idle ones take part with no batch
    sharded, _ = local.tensor_parallel(cfg.target_parallel, cfg.target_engine, target_dir, device)
    batches_left = sum(len(shards[i]) for i in todo)
    forwards = distributed.max_over_ranks(batches_left) if sharded else batches_left
    try:
        if todo or rank == 0 or sharded:
            backend = (
                target
                if target is not None
                else local.open_backend(
                    cfg.target_engine,
                    target_dir,
                    aux_layers,
                    device,
                    dtype,
                    memory=cfg.target_memory,
                    parallel=cfg.target_parallel,
                    vllm_tensor_parallel=cfg.target_tensor_parallel,
                )
            )
            backend.set_vocab_mapping(vocab_map.selected_token_ids)
            if tokens.images is not None:
                require_images(backend)
            if rank == 0:
                fc.write_head(
                    out,
                    backend.lm_head_selected,
                    backend.bias_selected,
                    vocab_map.selected_token_ids,
                    vocab_map.t2d,
                    backend.softcap,
                    backend.get_input_embeddings(),
                    (backend.get_output_head() or {}).get("final_norm"),
                )

        used = torch.get_num_threads()
        reason = (
            choice.reason
            if used == choice.threads
            else f"set by {cfg.target_engine} (asked for {choice.threads}: {choice.reason})"
        )
        meter = threads.Meter()
        loop_start = time.perf_counter()
        writer = ThreadPoolExecutor(
            max_workers=1
        )  # overlap writing a shard with computing the next
        pending = None
        label = f"precompute (rank {rank})" if world > 1 else "precompute"
        with progress(label, total=todo_tokens, unit="tokens") as bar:
            for shard in todo:
                tensors = _compute_shard(
                    backend,
                    tokens,
                    [batches[b] for b in shards[shard]],
                    cfg.encoding,
                    storage,
                    bar,
                    fields,
                )
                if pending is not None:
                    done[pending[0]] = pending[1].result()
                pending = (shard, writer.submit(fc.write_shard, out, shard, tensors, identity))
                if _TEST_SHARD_DELAY:  # lets tests interrupt a tiny run between shards
                    time.sleep(_TEST_SHARD_DELAY)
            if pending is not None:
                done[pending[0]] = pending[1].result()
            for _ in range(forwards - batches_left):  # the other ranks' remaining forwards
                backend.idle()
        writer.shutdown()
        computed = len(todo)
        compute_seconds = time.perf_counter() - loop_start
        busy = (
            meter.stop(used, threads.available_cores(), on_cpu=device.type == "cpu")
            if todo
            else None
        )

        # Each rank verified (at the start) or wrote its own shards: rank 0 collects their entries
        # rather than hashing the whole cache again while the others wait.
        by_rank = distributed.gather_to_main(done)
        manifest = None
        if rank == 0:
            verified = {i: e for part in by_rank for i, e in part.items()}
            entries = [verified.get(i) for i in range(len(shards))]
            if any(e is None for e in entries):
                raise ArtifactError(
                    "some shards are missing after all ranks finished",
                    "rerun the same command to compute them",
                )
            manifest = fc.write_manifest(
                out,
                identity,
                {
                    "architecture": backend.info["architecture"],
                    "vocab_size": backend.info["vocab_size"],
                    "hidden_size": backend.info["hidden_size"],
                    "num_layers": n_layers,
                    "draft_vocab_size": vocab_map.draft_vocab_size,
                    "target": str(target_dir),
                    "data": str(data_path),
                    "vocab_map": str(
                        Path(cfg.vocab_map).resolve()
                    ),  # provenance: named when a map mismatches
                    "bytes_per_token": per_token,
                    "head_bytes": (out / fc.HEAD).stat().st_size,
                    "target_config": config.to_dict(),
                    "target_engine": cfg.target_engine,  # provenance only: not part of the identity
                    "chat_template_source": chat_templates.source_of(tokenizer, template),
                    "tokenizer_base_fingerprint": loading.tokenizer_fingerprint(
                        tokenizer, chat_template=None
                    ),
                    # the samples with images (tokenised indices): training tells image-text batches apart
                    **(
                        {
                            "image_samples": torch.nonzero(tokens.num_images[:n_samples])
                            .squeeze(1)
                            .tolist()
                        }
                        if tokens.images is not None
                        else {}
                    ),
                },
                entries,
            )
        distributed.barrier()
    finally:  # also on an error or Ctrl-C: the target engine holds the model (vLLM also its KV cache)
        if backend is not None and backend is not target:
            backend.close()
        if cfg.target_engine == "transformers":  # vLLM replaces torch.set_num_threads once loaded
            torch.set_num_threads(previous)
    if manifest is None:
        manifest = fc.read_manifest(out)
    distributed.shutdown()
    return PrecomputeResult(
        manifest,
        out,
        time.perf_counter() - start,
        computed,
        len(shards) - computed if rank == 0 else len(mine) - computed,
        estimated,
        padding_fraction(lengths, batches),
        compute_seconds,
        todo_tokens,
        used,
        reason,
        busy,
        fc.folder_bytes(out) if rank == 0 else None,
    )


def _stored(t: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """t in the storage dtype, on the CPU; fp16 refuses values beyond its range (they would be inf)."""
    out = t.to(storage).cpu()
    if (
        storage == torch.float16
        and t.dtype != torch.float16
        and not bool(torch.isfinite(out).all())
        and bool(torch.isfinite(t).all())
    ):
        raise ArtifactError(
            f"the target's hidden states reach {float(t.abs().max()):.4g}, beyond fp16's "
            "range (65504)",
            "use --storage-dtype bf16 (fp32's range) or fp32",
        )
    return out


def stored_fields(algorithm: str) -> dict:
    """The per-token fields the cache stores for `algorithm` beyond the built-in supervision (its own
    TargetFields; the final hidden state is stored anyway with --encoding hidden)."""
    chosen = algorithms.get(algorithm)
    own = chosen.target_fields
    return {name: own[name] for name in chosen.field_needs() if name != FINAL_HIDDEN}


def _compute_shard(
    backend,
    tokens,
    shard_batches: list[list[int]],
    encoding: str,
    storage: torch.dtype,
    bar,
    fields: dict | None = None,
) -> dict:
    """Run the target on each batch and keep the real tokens only (ragged); float features in the
    storage dtype; `fields` (name -> TargetField) stored as `extra.NAME`."""
    fields = fields or {}
    backend.extra_fields = fields  # (a field reading the input embeddings turns their capture on)
    parts: dict[str, list[torch.Tensor]] = {
        k: []
        for k in (
            "input_ids",
            "loss_mask",
            "aux_hidden",
            "argmax",
            "final_hidden",
            "lse",
            "target_p",
            "target_mass",
            *(EXTRA + name for name in fields),
        )
    }
    sample_lengths, batch_sizes, sample_index = [], [], []
    for indices in shard_batches:
        input_ids, attention_mask, loss_mask = collate(tokens, indices)
        images = None if tokens.images is None else tokens.images(indices, input_ids.shape[1])
        if images is None:
            aux, hidden = backend.run_target(input_ids, attention_mask)
        else:  # image-text rows: the image features in place of their placeholders (data/vlm.py)
            aux, hidden = backend.run_target(input_ids, attention_mask, images=images)
        argmax, lse = backend.full_vocab_stats(hidden)
        if encoding == "probs":
            with torch.no_grad():
                from spec_cli.targets.supervision import draft_distribution

                target_p, target_mass = draft_distribution(backend.draft_logits(hidden), lse)
        real = attention_mask.bool().to(aux.device)  # [B, T]: ragged selection drops padding
        parts["input_ids"].append(input_ids[attention_mask.bool()].to(torch.int32))
        parts["loss_mask"].append(loss_mask[attention_mask.bool()].to(torch.uint8))
        parts["aux_hidden"].append(_stored(aux[real], storage))
        parts["argmax"].append(argmax[real].to(torch.int32).cpu())
        if encoding == "hidden":
            parts["final_hidden"].append(_stored(hidden[real], storage))
            parts["lse"].append(lse[real].cpu())
        else:
            parts["target_p"].append(_stored(target_p[real], storage))
            parts["target_mass"].append(target_mass[real].cpu())
        for name, value in backend.field_values(
            fields, hidden, aux, input_ids.to(aux.device)
        ).items():
            value = value[real]
            parts[EXTRA + name].append(
                _stored(value, storage) if value.is_floating_point() else value.cpu()
            )
        sample_lengths.extend(attention_mask.sum(1).tolist())
        batch_sizes.append(len(indices))
        sample_index.extend(indices)
        bar.advance(int(attention_mask.sum()))
    tensors = {k: torch.cat(v) for k, v in parts.items() if v}
    tensors["sample_offsets"] = torch.cumsum(torch.tensor([0] + sample_lengths), 0)
    tensors["batch_offsets"] = torch.cumsum(torch.tensor([0] + batch_sizes), 0)
    tensors["sample_index"] = torch.tensor(sample_index, dtype=torch.int64)
    return tensors
