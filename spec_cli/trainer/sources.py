"""Where the trainer's supervision comes from, and how the loop gets it, batch by batch.

open_source   one factory for a feature cache (--cache), a live target (--target) and served targets
              (--remote): it opens what is particular to each; for a live or served target it then
              tokenises the data (rank 0 first, the others read its cache) and plans the batches, the
              same steps for both, and with --stream sizes the store's bound from the largest planned
              batch (spec_cli/stream/bound.py) before a live target is loaded.
Schedule      the planned batches split into train and held-out eval batches, and which one each
              micro-batch trains on: epoch e visits the train batches in the order of a permutation
              seeded by (seed, e), so the data position is a function of the step alone.
open_batches  micro-batch number -> TargetBatch: made when the loop asks, or ahead of it by producer
              threads through a bounded store (spec_cli/stream) with --stream, and for --remote with
              --prefetch N. The batches are the same bit for bit either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli import assets, distributed
from spec_cli.batch import batch_nbytes
from spec_cli.console import info
from spec_cli.data import chat_templates
from spec_cli.data.batching import collate, collate_packed, plan_by_source, plan_packed
from spec_cli.draft import algorithms
from spec_cli.draft.algorithm import FINAL_HIDDEN
from spec_cli.errors import ArtifactError, ConfigError
from spec_cli.stream.bound import StoreBound, free_room, size_text, store_bound
from spec_cli.targets import loading, local
from spec_cli.targets.backend import TargetBackend, require_images
from spec_cli.train_options import TrainConfig

# --target-engine vllm in spec train: the share of the GPU vLLM may take when --target-memory is not
# given (vLLM's own default, 0.9, would leave the draft a tenth of the GPU)
TRAIN_TARGET_MEMORY = 0.5


@dataclass
class Source:
    backend: TargetBackend
    tokens: object  # TokenizedData
    plan: list[list[int]]  # batches of sample indices
    target_config: dict
    aux_layers: list[int]
    identity: dict  # target and tokenizer fingerprints, aux layers: what a --resume must match
    chat_template: dict = dataclasses.field(
        default_factory=dict
    )  # sha256 + source of the template used
    stream_bound: StoreBound | None = (
        None  # --stream: the store's byte bound and where it came from
    )
    # --context-parallel from a feature cache: rows of T slots -> (their padded length, the ranges of their
    # slots this rank reads); None: whole rows
    slots_for: object = None
    by_index: bool = False  # a feature cache with image rows: its samples are read by id (CacheBackend.read_host)
    target_dir: str | None = (
        None  # the target's folder where this machine has it (a cache names the one it was made from)
    )


def open_source(cfg: TrainConfig, device: torch.device, vocab_map) -> Source:
    """The backend a run trains from, the data's tokens and their batch plan, and what identifies them."""
    _check_options(cfg)
    d = cfg.data
    if d.cache is not None:
        return _cache_source(cfg, device, vocab_map)
    if d.data is None:
        raise ConfigError(
            f"{'--remote' if d.remote is not None else '--target'} needs --data",
            "pass the chat data to train on",
        )
    template = chat_templates.resolve(d.chat_template)
    target = (_served if d.remote is not None else _live)(cfg, vocab_map, template, device)
    try:
        data_path = Path(assets.resolve_data_arg(d.data))
        tokens = _tokenize(
            data_path,
            target.tokenizer,
            target.tokenizer_fingerprint,
            d.max_length,
            d.num_proc,
            target.processor,
        )
        n = len(tokens) if d.max_samples is None else min(d.max_samples, len(tokens))
        plan = (
            plan_packed(tokens.lengths[:n], d.batch_tokens)
            if d.pack
            else plan_by_source(tokens.lengths[:n], d.batch_tokens, tokens.num_images)
        )
        bound = (
            _stream_bound(cfg, target, vocab_map, tokens, plan, device)
            if cfg.runtime.stream
            else None
        )
        backend = (
            target.backend or target.load()
        )  # a live target is loaded once the data is tokenised
        if d.remote is not None and _grouped(
            cfg
        ):  # one rank of each context-parallel group asks the servers
            from spec_cli.targets.group import GroupTarget

            rank, group = distributed.context_group(cfg.runtime.context_parallel)
            if rank != 0:
                backend.close()
            info(
                "remote supervision: asked once per context-parallel group, by its first rank, which sends each "
                "other rank its slots of the rows"
            )
            backend = GroupTarget(
                backend if rank == 0 else None, group, rank, cfg.runtime.context_parallel, device
            )
        if cfg.runtime.stream and getattr(backend, "group", None) is not None:
            backend.close()
            raise ConfigError(
                "--stream runs the target in producer threads, each rank at its own pace; a "
                "target sharded over the ranks (--target-parallel) runs in step with them",
                "drop --stream, or pass --target-parallel replica if the target fits one device",
            )
        if getattr(tokens, "images", None) is not None:
            require_images(backend)
    except BaseException:
        if target.backend is not None:
            target.backend.close()
        raise
    identity = {
        "target_fingerprint": backend.info["target_fingerprint"],
        "tokenizer_fingerprint": target.tokenizer_fingerprint,
        "aux_layers": backend.info["aux_layers"],
    }
    target_dir = (
        None
        if d.remote is not None
        else str(loading.resolve_target(assets.resolve_target_arg(d.target)))
    )
    return Source(
        backend,
        tokens,
        plan,
        target.config,
        target.aux_layers,
        identity,
        target.template,
        bound,
        target_dir=target_dir,
    )


def _grouped(cfg: TrainConfig) -> bool:
    """Context parallelism over torchrun ranks (else Schedule.plan says what is wrong with the option)."""
    cp, world = cfg.runtime.context_parallel, distributed.world_size()
    return cp > 1 and world > 1 and world % cp == 0


def _check_options(cfg: TrainConfig) -> None:
    d, rt = cfg.data, cfg.runtime
    if sum(x is not None for x in (d.cache, d.target, d.remote)) != 1:
        raise ConfigError(
            "pass exactly one of --cache (a feature cache), --target (a live target) or "
            "--remote (served targets)",
            "e.g. spec train --cache cache/ --vocab-map vocab.safetensors -o runs/x",
        )
    if rt.stream and d.cache is not None:
        raise ConfigError(
            "--stream runs a live target ahead of the trainer; a feature cache is already on disk",
            "drop --stream, or train from --target / --remote",
        )
    if rt.stream_dir is not None and not rt.stream:
        raise ConfigError(
            "--stream-dir is where --stream keeps its samples", "add --stream, or drop --stream-dir"
        )
    if (
        rt.context_parallel > 1
        and d.cache is None
        and (rt.stream or (d.target and rt.target_parallel == "tensor"))
    ):
        raise ConfigError(
            f"with --context-parallel a {'live' if d.target else 'served'} target runs once per "
            "group, on its first rank, in step with the others: "
            + (
                "--stream's producer threads run each rank at its own pace"
                if rt.stream
                else "--target-parallel tensor shards it over every rank"
            ),
            "drop "
            + ("--stream" if rt.stream else "--target-parallel tensor")
            + ", or precompute a feature cache",
        )
    if rt.target_parallel not in local.PARALLEL:
        raise ConfigError(
            f"unknown --target-parallel {rt.target_parallel!r}",
            f"use one of {', '.join(local.PARALLEL)}",
        )
    if d.chat_template is not None and d.cache is not None:
        raise ConfigError(
            "--chat-template is for a live --target or --remote: a feature cache was tokenised "
            "when it was made",
            "drop --chat-template (pass it to `spec precompute` instead)",
        )


def _cache_source(cfg: TrainConfig, device: torch.device, vocab_map) -> Source:
    from spec_cli.targets.cache_backend import CacheBackend

    backend = CacheBackend(cfg.data.cache, device=device)
    m = backend.reader.manifest
    if m["vocab_map_fingerprint"] != vocab_map.fingerprint:
        made_with = f" ({m['vocab_map']})" if m.get("vocab_map") else ""
        raise ArtifactError(
            f"the vocab map {cfg.data.vocab_map} (fingerprint {vocab_map.fingerprint}) differs "
            f"from the one the feature cache was made with{made_with}, fingerprint "
            f"{m['vocab_map_fingerprint']}",
            "pass the --vocab-map used for `spec precompute`",
        )
    if _other_aux_layers(cfg, m["num_layers"], m["aux_layers"]):
        raise ArtifactError(
            f"--aux-layers {cfg.draft.aux_layers} differs from the cache's {m['aux_layers']}",
            "drop --aux-layers (the cache decides) or precompute again",
        )
    target_config = m.get("target_config") or loading.load_config(m["target"]).to_dict()
    tokens = backend.tokens()
    plan = plan_packed(tokens.lengths, cfg.data.batch_tokens) if cfg.data.pack else backend.plan()
    identity = {
        k: m[k]
        for k in ("target_fingerprint", "tokenizer_fingerprint", "aux_layers", "data_fingerprint")
        if k in m
    }  # the data too: a cache may move, a --resume checks it is the same one
    template = {
        k: m[k]
        for k in ("chat_template_sha256", "chat_template_source", "tokenizer_base_fingerprint")
        if k in m
    }
    images = getattr(tokens, "num_images", None)
    return Source(
        backend,
        tokens,
        plan,
        target_config,
        list(m["aux_layers"]),
        identity,
        template,
        by_index=images is not None and bool(images.any()),
        target_dir=m.get("target"),
    )


def _other_aux_layers(cfg: TrainConfig, num_layers: int, given: list[int]) -> bool:
    """Whether --aux-layers asks for other layers than the supervision was made with."""
    asked = cfg.draft.aux_layers
    return (
        asked not in (None, "", "auto")
        and loading.parse_aux_layers(asked, num_layers, cfg.draft.algorithm) != given
    )


@dataclass
class _Target:
    """A live or served target, as far as the data (and the stream's bound) need it before it is loaded."""

    tokenizer: object
    tokenizer_fingerprint: str
    aux_layers: list[int]
    config: dict  # the target's config.json
    template: dict  # what artifacts record about the chat template
    hidden_size: int
    dtype: torch.dtype  # of its hidden states
    backend: TargetBackend | None = None  # served: connected already
    load: Callable[[], TargetBackend] | None = None  # live: loads the model
    on_device: int = 0  # bytes a live target will take on its device once loaded
    processor: object = (
        None  # loads a vision-language target's processor (data/vlm.py), for image-text data
    )


def _live(cfg: TrainConfig, vocab_map, template, device: torch.device) -> _Target:
    target_dir = loading.resolve_target(assets.resolve_target_arg(cfg.data.target))
    config = loading.load_config(target_dir)
    aux_layers = loading.parse_aux_layers(
        cfg.draft.aux_layers, loading.num_layers(config), cfg.draft.algorithm
    )
    local.check_reads_input_embeds(
        cfg.runtime.target_engine, algorithms.get(cfg.draft.algorithm), "train"
    )
    tokenizer = loading.load_tokenizer(target_dir, template)
    fingerprint = loading.check_tokenizer(
        vocab_map.metadata,
        tokenizer,
        template,
        f"the vocab map {cfg.data.vocab_map}",
        "rebuild it with `spec build-vocab-map` for this target",
    )
    dtype = loading.choose_dtype(cfg.runtime.dtype, device)

    cp, grouped = cfg.runtime.context_parallel, _grouped(cfg)

    def open_local(parallel: str) -> TargetBackend:
        return local.open_backend(
            cfg.runtime.target_engine,
            target_dir,
            aux_layers,
            device,
            dtype,
            template,
            parallel=parallel,
            vllm_tensor_parallel=cfg.runtime.target_tensor_parallel,
            memory=TRAIN_TARGET_MEMORY
            if cfg.runtime.target_memory is None
            else cfg.runtime.target_memory,
        )

    def load() -> TargetBackend:
        if not grouped:
            return open_local(cfg.runtime.target_parallel)
        from spec_cli.targets.group import (
            GroupTarget,  # once per context-parallel group, on its first rank
        )

        rank, group = distributed.context_group(cp)
        info(
            f"target: runs once per context-parallel group of {cp} ranks, on its first rank, which sends each "
            "other rank its slots of the rows (the others hold none of the target)"
        )
        return GroupTarget(open_local("replica") if rank == 0 else None, group, rank, cp, device)

    record = chat_templates.identity(tokenizer, template)
    hidden_size = int(getattr(config, "hidden_size", None) or config.text_config.hidden_size)
    on_device = 0
    if (
        device.type == "cuda"
    ):  # what loading will take of the GPU the stream's room is measured on now
        share = (
            TRAIN_TARGET_MEMORY if cfg.runtime.target_memory is None else cfg.runtime.target_memory
        )
        on_device = (
            int(share * torch.cuda.get_device_properties(device).total_memory)
            if cfg.runtime.target_engine == "vllm"
            else loading.weights_bytes(target_dir)
        )
    return _Target(
        tokenizer,
        fingerprint,
        aux_layers,
        config.to_dict(),
        record,
        hidden_size,
        dtype,
        load=load,
        on_device=on_device,
        processor=loading.processor_loader(target_dir),
    )


def _served(cfg: TrainConfig, vocab_map, template, device: torch.device) -> _Target:
    from spec_cli.serve.client import RemoteBackend

    # With --chat-template the trainer's own template replaces the server's, so the tokenizer is checked
    # once it is here (below), not against what the server reports.
    expect = (
        {}
        if template
        else {"tokenizer_fingerprint": vocab_map.metadata.get("tokenizer_fingerprint")}
    )
    backend = RemoteBackend(
        cfg.data.remote,
        token=cfg.data.token,
        expect=expect,
        tensor_plane=cfg.data.tensor_plane,
        device=device,
    )
    info(f"remote supervision: {backend.transport}")
    try:
        aux_layers = backend.info["aux_layers"]
        if _other_aux_layers(cfg, backend.info["num_layers"], aux_layers):
            raise ConfigError(
                f"--aux-layers {cfg.draft.aux_layers} differs from the server's {aux_layers}",
                "drop --aux-layers (the server decides) or restart it with them",
            )
        tokenizer = chat_templates.apply(backend.load_tokenizer(), template)
        fingerprint = backend.info["tokenizer_fingerprint"]
        if template is not None:
            fingerprint = loading.check_tokenizer(
                vocab_map.metadata,
                tokenizer,
                template,
                f"the vocab map {cfg.data.vocab_map}",
                "rebuild it with `spec build-vocab-map` for this target and --chat-template",
            )
    except BaseException:
        backend.close()
        raise
    record = chat_templates.identity(tokenizer, template)
    if template is None and backend.servers[0].info.get(
        "chat_template_source"
    ):  # serve-target --chat-template
        record["chat_template_source"] = backend.servers[0].info["chat_template_source"]
    dtype = getattr(torch, str(backend.info.get("dtype")), None)
    dtype = (
        dtype if isinstance(dtype, torch.dtype) else torch.float32
    )  # not said: the widest it sends
    folder = getattr(
        backend, "tokenizer_folder", None
    )  # the server's files: a VLM's processor among them
    processor = loading.processor_loader(folder)
    return _Target(
        tokenizer,
        fingerprint,
        aux_layers,
        backend.target_config,
        record,
        int(backend.info["hidden_size"]),
        dtype,
        backend=backend,
        processor=processor,
    )


def _stream_bound(
    cfg: TrainConfig,
    target: _Target,
    vocab_map,
    tokens,
    plan: list[list[int]],
    device: torch.device,
) -> StoreBound:
    """--stream's store bound (spec_cli/stream/bound.py) for the run's largest planned batch, whose bytes
    are known before the target runs: the fields of spec_cli/batch.py at the target's hidden size, aux
    layers and dtype, the draft vocab, and what the --algorithm asks for beyond them."""
    algorithm = algorithms.get(cfg.draft.algorithm)
    H = target.hidden_size
    widths = tuple(
        algorithm.target_fields[name].width(H)
        for name in algorithm.field_needs()
        if name != FINAL_HIDDEN and name in algorithm.target_fields
    )

    def nbytes(batch: list[int]) -> int:
        lengths = tokens.lengths[batch]
        rows, length, docs = (
            (1, int(lengths.sum()), len(batch))
            if cfg.data.pack  # one packed row
            else (len(batch), int(lengths.max()), 0)
        )  # padded to its longest
        return batch_nbytes(
            rows,
            length,
            H,
            len(target.aux_layers),
            vocab_map.draft_vocab_size,
            target.dtype,
            algorithm.final_hidden,
            widths,
            docs,
        )

    largest = max((nbytes(b) for b in plan), default=0)
    # the samples live where the target made them: a live target's device; a served one's host memory,
    # or this GPU when its tensor plane is NCCL
    held_on = device if cfg.data.remote is None else target.backend.lands_on
    free, where = free_room(cfg.runtime.stream_dir, held_on)
    if free is not None and cfg.runtime.stream_dir is None and held_on.type == "cuda":
        free = max(
            0, free - target.on_device
        )  # measured before the target loads: its share is not free
        where += f" less the target's {size_text(target.on_device)}"
    return store_bound(cfg.runtime.stream_max_bytes, largest, cfg.runtime.prefetch + 1, free, where)


def _tokenize(
    path: Path, tokenizer, fingerprint: str, max_length: int, num_proc: int, processor=None
):
    """The data's tokens: rank 0 tokenises (and caches) them, the other ranks then read its cache."""
    from spec_cli.data.tokenize import tokenize_data, tokenize_seconds_bound

    if distributed.is_main():
        tokens = tokenize_data(
            path, tokenizer, fingerprint, max_length, num_proc, load_processor=processor
        )
    distributed.wait_for_main("tokenising the data", tokenize_seconds_bound(path))
    if not distributed.is_main():
        tokens = tokenize_data(
            path, tokenizer, fingerprint, max_length, 1, load_processor=processor
        )
    return tokens


# ----------------------------------------------------------------------------- the schedule


def by_source(batches: list[list[int]], tokens) -> tuple[list, list]:
    """(text batches, image-text batches): a batch with an image sample is an image-text one."""
    images = getattr(tokens, "num_images", None)
    multimodal = [images is not None and any(int(images[i]) for i in b) for b in batches]
    return [b for b, m in zip(batches, multimodal) if not m], [
        b for b, m in zip(batches, multimodal) if m
    ]


def split_eval(plan: list[list[int]], fraction: float, seed: int) -> tuple[list, list]:
    """(train batches, held-out eval batches): a seeded choice of whole batches."""
    n_eval = 0 if fraction <= 0 or len(plan) < 2 else max(1, round(len(plan) * fraction))
    order = torch.randperm(len(plan), generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    held = set(order[:n_eval])
    return [b for i, b in enumerate(plan) if i not in held], [
        b for i, b in enumerate(plan) if i in held
    ]


@dataclass
class Schedule:
    """What each optimizer step trains on: this rank's micro-batch i of step s is number s * grad_accum + i."""

    train: list[list[int]]  # batches of sample indices
    eval: list[list[int]]
    total_steps: int  # optimizer steps
    grad_accum: int  # micro-batches per step on each rank
    seed: int
    rank: int
    world: int
    context: int = (
        1  # --context-parallel: consecutive ranks that share each batch (a row's slots split)
    )
    # MSD's curriculum (spec_cli/draft/msd/curriculum.py): each step's source, and the train batches of
    # each source (text, image-text)
    curriculum: object = None
    pools: tuple = ()

    @classmethod
    def plan(cls, source: Source, cfg: TrainConfig) -> Schedule:
        curriculum = algorithms.get(cfg.draft.algorithm).curriculum
        if curriculum:  # each source keeps its share of train and held-out batches
            parts = [
                split_eval(pool, cfg.data.eval_fraction, cfg.optim.seed + 31 * kind)
                for kind, pool in enumerate(by_source(source.plan, source.tokens))
            ]
            train, held = parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]
        else:
            train, held = split_eval(source.plan, cfg.data.eval_fraction, cfg.optim.seed)
        if not train:
            raise ConfigError("no training batches", "use more data or a smaller --eval-fraction")
        world, context = distributed.world_size(), cfg.runtime.context_parallel
        if world % context:
            raise ConfigError(
                f"--context-parallel {context} does not divide the {world} torchrun processes",
                "launch a multiple of it (torchrun --nproc-per-node), or choose a divisor",
            )
        per_step = cfg.optim.grad_accum * (world // context)
        total = cfg.optim.max_steps or max(1, int(cfg.optim.epochs * len(train)) // per_step)
        schedule = cls(
            train,
            held,
            total,
            cfg.optim.grad_accum,
            cfg.optim.seed,
            distributed.rank(),
            world,
            context,
        )
        if curriculum:
            schedule.follow_curriculum(source, cfg)
        return schedule

    def follow_curriculum(self, source: Source, cfg: TrainConfig) -> None:
        """Split the train batches by source (a batch with an image is an image-text batch) and check that
        the curriculum's steps find batches of each source they draw."""
        from spec_cli.draft.msd.curriculum import Curriculum

        o = cfg.objective
        self.curriculum = Curriculum(
            o.text_steps, o.multimodal_ratio, o.multimodal_ramp_steps, self.seed
        )
        images = getattr(source.tokens, "num_images", None)
        if cfg.data.pack and images is not None and bool(images.any()):
            raise ConfigError(
                "--pack puts image-text and text chats in one row; the MSD curriculum trains on "
                "each source's batches apart",
                "drop --pack",
            )
        self.pools = text, image_text = by_source(self.train, source.tokens)
        wants_text, wants_images = self.curriculum.uses(self.total_steps)
        if wants_images and not image_text:
            raise ConfigError(
                f"the MSD curriculum trains {self.curriculum.steps_before(self.total_steps, 1)} of "
                f"{self.total_steps} steps on image-text batches and the data has none",
                "train on image-text chats with a target saved with its processor (docs/vlm.md), or "
                "pass --multimodal-ratio 0",
            )
        if wants_text and not text:
            raise ConfigError(
                f"the MSD curriculum trains {self.curriculum.steps_before(self.total_steps, 0)} of "
                f"{self.total_steps} steps on text batches and the data has none",
                "add text chats, or pass --text-steps 0 --multimodal-ratio 1",
            )
        self.check_curriculum_agrees()

    def check_curriculum_agrees(self) -> None:
        """Under torchrun every rank must draw the same source at every step (a DDP step averages gradients
        of batches of one source; a context-parallel group shares its batches): the sources of all steps
        and the pools' sizes, hashed, compared over the ranks. They agree by construction (the seed and the
        step alone choose); what this catches is ranks that read other data or options."""
        if distributed.world_size() <= 1:
            return
        plan = ",".join(str(self.curriculum.source(step)) for step in range(self.total_steps))
        text = f"{plan}|{len(self.pools[0])}|{len(self.pools[1])}|{self.curriculum.seed}"
        mine = int.from_bytes(
            hashlib.sha256(text.encode()).digest()[:7], "big"
        )  # < 2^56: exact in int64
        if distributed.max_over_ranks(mine) != -distributed.max_over_ranks(-mine):
            raise ConfigError(
                f"the MSD curriculum differs between ranks (rank {distributed.rank()}: "
                f"{len(self.pools[0])} text and {len(self.pools[1])} image-text batches, seed "
                f"{self.curriculum.seed})",
                "give every rank the same data, options and seed",
            )

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel replicas (its context-parallel group's)."""
        return self.rank // self.context

    @property
    def data_world(self) -> int:
        """Data-parallel replicas: groups of --context-parallel ranks, each training its own batches."""
        return self.world // self.context

    @property
    def per_step(self) -> int:
        """Micro-batches per optimizer step, all ranks together (a batch split over a context-parallel
        group counts once)."""
        return self.grad_accum * self.data_world

    def epoch(self, step: int) -> int:
        """The epoch the run is in after `step` optimizer steps."""
        return step * self.per_step // len(self.train)

    def indices(self, i: int) -> list[int]:
        """The samples of this rank's i-th micro-batch (global micro-batch i * data_world + data_rank: the
        ranks of a context-parallel group get the same ones). Under a curriculum, step i // grad_accum
        draws its source, and its micro-batches are that source's next ones, in its own epochs."""
        if self.curriculum is None:
            epoch, pos = divmod(i * self.data_world + self.data_rank, len(self.train))
            order = torch.randperm(
                len(self.train), generator=torch.Generator().manual_seed(self.seed + epoch)
            )
            return self.train[int(order[pos])]
        step, micro = divmod(i, self.grad_accum)
        kind = self.curriculum.source(step)
        pool = self.pools[kind]
        n = self.curriculum.steps_before(step, kind)  # the steps on this source before this one
        epoch, pos = divmod(
            (n * self.grad_accum + micro) * self.data_world + self.data_rank, len(pool)
        )
        order = torch.randperm(
            len(pool), generator=torch.Generator().manual_seed(self.seed + epoch + 7919 * kind)
        )
        return pool[int(order[pos])]


# ----------------------------------------------------------------------------- batches


def inputs_for(source: Source, indices: list[int], pack: bool) -> dict:
    """The keyword arguments of generate_batch for one batch of samples (under --context-parallel from a
    cache: rows padded to the group's chunks, and the slots this rank reads)."""
    reader = getattr(source.tokens, "images", None)
    if pack:
        ids, am, lm, seq_lens = collate_packed(source.tokens, indices)
        inputs = {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "seq_lens": seq_lens}
        images = (
            None if reader is None else reader(indices, ids.shape[1], packed=True)
        )  # the row's documents' images
        if images is not None:
            inputs["images"] = images
    else:
        ids, am, lm = collate(source.tokens, indices)
        inputs = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
        images = None if reader is None else reader(indices, ids.shape[1])
        if (
            images is not None
        ):  # image-text rows: the target runs its vision part on them (data/vlm.py)
            inputs["images"] = images
    if source.by_index:
        inputs["samples"] = list(indices)
    if source.slots_for is not None:
        length, slots = source.slots_for(ids.shape[1])
        extra = length - ids.shape[1]
        for name in (
            "input_ids",
            "attention_mask",
            "loss_mask",
        ):  # right padding: no token, no loss
            inputs[name] = torch.nn.functional.pad(inputs[name], (0, extra))
        inputs["slots"] = slots
    return inputs


def supervise(source: Source, indices: list[int], pack: bool, device: torch.device):
    return source.backend.generate_batch(**inputs_for(source, indices, pack)).to(device)


class _WhenAsked:
    """Micro-batches made when the loop asks for them."""

    def __init__(self, source: Source, schedule: Schedule, pack: bool, device: torch.device):
        self.source, self.schedule, self.pack, self.device = source, schedule, pack, device

    def get(self, i: int):
        return supervise(self.source, self.schedule.indices(i), self.pack, self.device)

    def close(self) -> None:
        pass


class _ReadAhead:
    """Feature-cache micro-batches read `depth` ahead of the loop by one thread: the shards' slice
    reads and their layout into padded host tensors (`read`) run while the device computes the step
    before; on CUDA the thread also pins them, so that the copy to the GPU does not make the host wait.
    The loop's thread then decodes each on the device (`finish`: for --encoding hidden, the target's
    distribution over the draft vocab from the stored final states). The thread does no device work
    (pinning only takes page-locked host memory): decoding there would bring the [T, Vd]
    distribution back to the host to pin it, which costs a long step more than the read saves
    (docs/recipe.md, "The trainer's choices"). The batches are the ones made when asked, bit for
    bit; a read's error is raised by `get`."""

    def __init__(self, read, finish, device: torch.device, start: int, end: int, depth: int):
        from concurrent.futures import ThreadPoolExecutor

        self.read, self.finish, self.device, self.end, self.depth = read, finish, device, end, depth
        self.pinned = device.type == "cuda"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="spec-cache-read")
        self.pending: dict = {}
        self._ahead(start)

    def _load(self, i: int):
        batch = self.read(i)
        return batch.pin_memory() if self.pinned else batch

    def _ahead(self, i: int) -> None:
        for j in range(i, min(i + 1 + self.depth, self.end)):
            if j not in self.pending:
                self.pending[j] = self.pool.submit(self._load, j)

    def get(self, i: int):
        for j in [
            j for j in self.pending if j < i
        ]:  # skipped (never asked for): not needed any more
            self.pending.pop(j).cancel()
        self._ahead(i)
        batch = self.pending.pop(i).result()
        return self.finish(batch.to(self.device, non_blocking=self.pinned))

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)  # a read in flight ends before the backend is closed
        self.pending.clear()


def open_batches(
    cfg: TrainConfig, source: Source, schedule: Schedule, start: int, device: torch.device
):
    """This rank's micro-batches start, start + 1, ...: `.get(i)` -> TargetBatch on `device`; `.close()`.

    From a feature cache with --prefetch N > 0, one thread reads N batches ahead (_ReadAhead).
    With --stream, and for --remote with --prefetch N > 0, producer threads make them ahead of the loop
    (spec_cli/stream): an in-process target one batch at a time (its backend is wrapped so that
    evaluation can share it), remote servers N requests at once. The store holds at most N + 1 batches
    and, with --stream, the bytes open_source sized (source.stream_bound). Otherwise each is made when asked."""
    rt, remote = cfg.runtime, cfg.data.remote is not None
    from spec_cli.stream import (
        FolderStore,
        MemoryStore,
        Producer,
        SerializedBackend,
        StreamLoader,
        new_run_id,
    )

    if cfg.data.cache is not None and rt.prefetch > 0:
        cache = source.backend
        source.backend = SerializedBackend(
            cache
        )  # the reading thread and evaluation share its files
        end = schedule.total_steps * schedule.grad_accum

        def read(i: int):
            with source.backend.lock:
                return cache.read_host(**inputs_for(source, schedule.indices(i), cfg.data.pack))

        return _ReadAhead(read, cache.finish, device, start, end, rt.prefetch)
    if getattr(
        source.backend, "in_step", False
    ):  # a context-parallel group's target: asked on every rank alike
        if remote and rt.prefetch > 0:
            info(
                "--prefetch: a context-parallel group asks its target in step, on every rank's main thread: "
                "each batch is asked for when the loop needs it"
            )
        return _WhenAsked(source, schedule, cfg.data.pack, device)
    if not (rt.stream or (remote and rt.prefetch > 0)):
        return _WhenAsked(source, schedule, cfg.data.pack, device)

    run_id = new_run_id()
    bound = source.stream_bound if rt.stream else None
    if bound is not None:
        info(f"stream store: at most {size_text(bound.max_bytes)} ({bound.source})")
    bounds = dict(max_samples=rt.prefetch + 1, max_bytes=None if bound is None else bound.max_bytes)
    if rt.stream_dir is not None:
        store = FolderStore(Path(rt.stream_dir) / f"spec-stream-{run_id}", **bounds)
    else:
        store = MemoryStore(**bounds)
    if not remote:
        source.backend = SerializedBackend(source.backend)
    producer = Producer(
        source.backend, store, run_id, target_version=source.identity["target_fingerprint"]
    )
    return StreamLoader(
        producer,
        lambda i: inputs_for(source, schedule.indices(i), cfg.data.pack),
        start,
        schedule.total_steps * schedule.grad_accum,
        prefetch=rt.prefetch,
        workers=max(1, rt.prefetch) if remote else 1,
        device=device,
        bound_source=None if bound is None else bound.source,
    )
