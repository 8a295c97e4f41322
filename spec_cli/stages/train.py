"""`spec train`: train an EAGLE-3 draft with the TTT unroll.

Supervision comes from a feature cache (`--cache`) or a live target (`--target`), both through the
TargetBackend interface. The batch plan is fixed up front and epoch e visits it in the order of a
permutation seeded by (seed, e), so the data position is a function of the step alone: `--resume`
continues exactly where a run stopped. With `--stream` a live target runs in producer threads ahead
of the trainer, through a bounded store (spec_cli/stream); the batches, and so the weights, are the
same bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spec_cli import assets, distributed
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts.io import write_json
from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.console import info
from spec_cli.data import chat_templates
from spec_cli.data.batching import collate, collate_packed, plan_batches, plan_packed
from spec_cli.draft import algorithms, sharding
from spec_cli.errors import ArtifactError, ConfigError
from spec_cli.stages.train_log import TrainLogger, plot_curves
from spec_cli.stages.train_options import OPTIONS, RESUMABLE, OptimOptions, TrainConfig
from spec_cli.target import loading, local
from spec_cli.target.backend import TargetBackend


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    seconds: float
    final_train: dict | None
    final_eval: dict | None
    plot: Path | None
    total_steps: int | None = None  # the planned steps (> steps when --max-time stopped the run)
    stream: dict | None = None  # the stream store's health report (--stream)


# ----------------------------------------------------------------------------- data sources

@dataclass
class Source:
    backend: object  # TargetBackend
    tokens: object  # TokenizedData
    plan: list[list[int]]
    target_config: dict
    aux_layers: list[int]
    identity: dict
    chat_template: dict = dataclasses.field(default_factory=dict)  # sha256 + source of the template used


def open_source(cfg: TrainConfig, device: torch.device, vocab_map) -> Source:
    if sum(x is not None for x in (cfg.data.cache, cfg.data.target, cfg.data.remote)) != 1:
        raise ConfigError("pass exactly one of --cache (a feature cache), --target (a live target) or "
                          "--remote (served targets)",
                          "e.g. spec train --cache cache/ --vocab-map vocab.safetensors -o runs/x")
    if cfg.runtime.stream and cfg.data.cache is not None:
        raise ConfigError("--stream runs a live target ahead of the trainer; a feature cache is already "
                          "on disk", "drop --stream, or train from --target / --remote")
    if cfg.runtime.stream_dir is not None and not cfg.runtime.stream:
        raise ConfigError("--stream-dir is where --stream keeps its samples", "add --stream, or drop "
                          "--stream-dir")
    if cfg.data.chat_template is not None and cfg.data.cache is not None:
        raise ConfigError("--chat-template is for a live --target or --remote: a feature cache was tokenised "
                          "when it was made", "drop --chat-template (pass it to `spec precompute` instead)")
    if cfg.data.remote is not None:
        return _remote_source(cfg, vocab_map)
    if cfg.data.cache is not None:
        from spec_cli.target.cache_backend import CacheBackend

        backend = CacheBackend(cfg.data.cache, device=device)
        m = backend.reader.manifest
        if m["vocab_map_fingerprint"] != vocab_map.fingerprint:
            made_with = f" ({m['vocab_map']})" if m.get("vocab_map") else ""
            raise ArtifactError(f"the vocab map {cfg.data.vocab_map} (fingerprint {vocab_map.fingerprint}) "
                                f"differs from the one the feature cache was made with{made_with}, fingerprint "
                                f"{m['vocab_map_fingerprint']}",
                                "pass the --vocab-map used for `spec precompute`")
        if cfg.draft.aux_layers not in (None, "", "auto") and \
                loading.parse_aux_layers(cfg.draft.aux_layers, m["num_layers"], cfg.draft.algorithm) \
                != m["aux_layers"]:
            raise ArtifactError(f"--aux-layers {cfg.draft.aux_layers} differs from the cache's "
                                f"{m['aux_layers']}",
                                "drop --aux-layers (the cache decides) or precompute again")
        target_config = m.get("target_config") or loading.load_config(m["target"]).to_dict()
        tokens = backend.tokens()
        plan = backend.plan() if not cfg.data.pack else plan_packed(tokens.lengths, cfg.data.batch_tokens)
        identity = {k: m[k] for k in ("target_fingerprint", "tokenizer_fingerprint", "aux_layers")}
        template = {k: m[k] for k in ("chat_template_sha256", "chat_template_source",
                                      "tokenizer_base_fingerprint") if k in m}
        return Source(backend, tokens, plan, target_config, list(m["aux_layers"]), identity, template)

    from spec_cli.data.tokenize import tokenize_data

    if cfg.data.data is None:
        raise ConfigError("--target needs --data", "pass the chat data to train on")
    target_dir = loading.resolve_target(assets.resolve_target_arg(cfg.data.target))
    config = loading.load_config(target_dir)
    aux_layers = loading.parse_aux_layers(cfg.draft.aux_layers, loading.num_layers(config), cfg.draft.algorithm)
    template = chat_templates.resolve(cfg.data.chat_template)
    tokenizer = loading.load_tokenizer(target_dir, template)
    tok_fp = loading.check_tokenizer(vocab_map.metadata, tokenizer, template,
                                     f"the vocab map {cfg.data.vocab_map}",
                                     "rebuild it with `spec build-vocab-map` for this target")
    data_path = Path(assets.resolve_data_arg(cfg.data.data))
    if distributed.is_main():
        tokens = tokenize_data(data_path, tokenizer, tok_fp, cfg.data.max_length, cfg.data.num_proc)
    distributed.barrier()
    if not distributed.is_main():
        tokens = tokenize_data(data_path, tokenizer, tok_fp, cfg.data.max_length, 1)
    n = len(tokens) if cfg.data.max_samples is None else min(cfg.data.max_samples, len(tokens))
    lengths = tokens.lengths[:n]
    plan = (plan_packed if cfg.data.pack else plan_batches)(lengths, cfg.data.batch_tokens)
    dtype = loading.choose_dtype(cfg.runtime.dtype, device)
    backend = local.open_backend(cfg.runtime.target_engine, target_dir, aux_layers, device, dtype, template)
    identity = {k: backend.info[k] for k in ("target_fingerprint", "tokenizer_fingerprint", "aux_layers")}
    return Source(backend, tokens, plan, config.to_dict(), aux_layers, identity,
                  chat_templates.identity(tokenizer, template))


def _remote_source(cfg: TrainConfig, vocab_map) -> Source:
    from spec_cli.data.tokenize import tokenize_data
    from spec_cli.serve.client import RemoteBackend

    if cfg.data.data is None:
        raise ConfigError("--remote needs --data", "pass the chat data to train on")
    template = chat_templates.resolve(cfg.data.chat_template)
    # With --chat-template the trainer's own template replaces the server's, so the tokenizer is checked
    # once it is here (below), not against what the server reports.
    expect = {} if template else {"tokenizer_fingerprint": vocab_map.metadata.get("tokenizer_fingerprint")}
    backend = RemoteBackend(cfg.data.remote, token=cfg.data.token, prefetch=cfg.runtime.prefetch, expect=expect)
    try:
        aux_layers = backend.info["aux_layers"]
        if cfg.draft.aux_layers not in (None, "", "auto") and \
                loading.parse_aux_layers(cfg.draft.aux_layers, backend.info["num_layers"], cfg.draft.algorithm) \
                != aux_layers:
            raise ConfigError(f"--aux-layers {cfg.draft.aux_layers} differs from the server's {aux_layers}",
                              "drop --aux-layers (the server decides) or restart it with them")
        tokenizer = chat_templates.apply(backend.load_tokenizer(), template)
        tok_fp = backend.info["tokenizer_fingerprint"]
        if template is not None:
            tok_fp = loading.check_tokenizer(vocab_map.metadata, tokenizer, template, f"the vocab map "
                                             f"{cfg.data.vocab_map}", "rebuild it with `spec build-vocab-map` "
                                             "for this target and --chat-template")
        data_path = Path(assets.resolve_data_arg(cfg.data.data))
        if distributed.is_main():
            tokens = tokenize_data(data_path, tokenizer, tok_fp, cfg.data.max_length, cfg.data.num_proc)
        distributed.barrier()
        if not distributed.is_main():
            tokens = tokenize_data(data_path, tokenizer, tok_fp, cfg.data.max_length, 1)
    except BaseException:
        backend.close()
        raise
    n = len(tokens) if cfg.data.max_samples is None else min(cfg.data.max_samples, len(tokens))
    lengths = tokens.lengths[:n]
    plan = (plan_packed if cfg.data.pack else plan_batches)(lengths, cfg.data.batch_tokens)
    identity = {"target_fingerprint": backend.info["target_fingerprint"], "tokenizer_fingerprint": tok_fp,
                "aux_layers": backend.info["aux_layers"]}
    template_record = chat_templates.identity(tokenizer, template)
    if template is None and backend.servers[0].info.get("chat_template_source"):  # serve-target --chat-template
        template_record["chat_template_source"] = backend.servers[0].info["chat_template_source"]
    return Source(backend, tokens, plan, backend.target_config, aux_layers, identity, template_record)


def split_eval(plan: list[list[int]], fraction: float, seed: int) -> tuple[list, list]:
    """(train batches, held-out eval batches): a seeded choice of whole batches."""
    n_eval = 0 if fraction <= 0 or len(plan) < 2 else max(1, round(len(plan) * fraction))
    order = torch.randperm(len(plan), generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    held = set(order[:n_eval])
    return [b for i, b in enumerate(plan) if i not in held], [b for i, b in enumerate(plan) if i in held]


def batch_at(train_batches: list, g: int, seed: int) -> tuple[int, list[int]]:
    """(epoch, sample indices) of global micro-batch number g."""
    epoch, pos = divmod(g, len(train_batches))
    order = torch.randperm(len(train_batches), generator=torch.Generator().manual_seed(seed + epoch))
    return epoch, train_batches[int(order[pos])]


def inputs_for(source: Source, indices: list[int], pack: bool) -> dict:
    """The keyword arguments of generate_batch for one batch of samples."""
    if pack:
        ids, am, lm, seq_lens = collate_packed(source.tokens, indices)
        return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "seq_lens": seq_lens}
    ids, am, lm = collate(source.tokens, indices)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def supervise(source: Source, indices: list[int], pack: bool, device: torch.device):
    return source.backend.generate_batch(**inputs_for(source, indices, pack)).to(device)


def submit(source: Source, indices: list[int], pack: bool):
    """Start supervision asynchronously; None when the backend cannot."""
    return source.backend.submit(**inputs_for(source, indices, pack))


def open_stream(cfg: TrainConfig, source: Source, indices_of, start: int, stop: int,
                device: torch.device):
    """Producer threads that supervise micro-batches start..stop-1 ahead of the trainer (--stream).

    An in-process target runs one batch at a time (its backend is wrapped so that evaluation can
    share it); remote servers get --prefetch requests at once. The store holds at most --prefetch + 1
    batches and --stream-max-bytes bytes."""
    from spec_cli.stream import (FolderStore, MemoryStore, Producer, SerializedBackend, StreamLoader,
                                 new_run_id)

    run_id = new_run_id()
    bounds = dict(max_samples=cfg.runtime.prefetch + 1, max_bytes=cfg.runtime.stream_max_bytes)
    if cfg.runtime.stream_dir is not None:
        store = FolderStore(Path(cfg.runtime.stream_dir) / f"spec-stream-{run_id}", **bounds)
    else:
        store = MemoryStore(**bounds)
    if cfg.data.remote is None:
        source.backend = SerializedBackend(source.backend)
    producer = Producer(source.backend, store, run_id, target_version=source.identity["target_fingerprint"])
    workers = max(1, cfg.runtime.prefetch) if cfg.data.remote is not None else 1
    return StreamLoader(producer, lambda i: inputs_for(source, indices_of(i), cfg.data.pack), start, stop,
                        prefetch=cfg.runtime.prefetch, workers=workers, device=device)


# ----------------------------------------------------------------------------- schedule / model

def lr_at(step: int, total: int, optim: OptimOptions) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    warmup = max(1, math.ceil(optim.warmup_ratio * total)) if optim.warmup_ratio > 0 else 0
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Metrics:
    """Sums over micro-batches (and ranks) of the TTT metrics."""

    def __init__(self, k: int):
        self.loss = torch.zeros(1, dtype=torch.float64)
        self.step_loss = torch.zeros(k, dtype=torch.float64)
        self.correct = torch.zeros(k, dtype=torch.float64)
        self.total = torch.zeros(k, dtype=torch.float64)
        self.tokens = torch.zeros(1, dtype=torch.float64)
        self.batches = torch.zeros(1, dtype=torch.float64)

    def add(self, out, tokens: int) -> None:
        self.loss += float(out.loss.detach())
        self.step_loss += out.step_loss.detach().double().cpu()
        self.correct += out.correct.double().cpu()
        self.total += out.total.double().cpu()
        self.tokens += tokens
        self.batches += 1

    def all_reduce(self) -> None:
        if distributed.world_size() > 1 and torch.distributed.is_initialized():  # not vLLM's own group
            flat = torch.cat([self.loss, self.step_loss, self.correct, self.total, self.tokens, self.batches])
            torch.distributed.all_reduce(flat)
            k = self.correct.numel()
            self.loss, self.step_loss, self.correct, self.total, self.tokens, self.batches = flat.split(
                [1, k, k, k, 1, 1])

    def record(self) -> dict:
        n = max(float(self.batches), 1.0)
        acc = (self.correct / self.total.clamp_min(1)).tolist()
        accept, prod = 1.0, 1.0
        for a in acc:
            prod *= a
            accept += prod
        return {"loss": float(self.loss) / n, "step_loss": (self.step_loss / n).tolist(), "acc": acc,
                "acceptance_length": accept, "tokens": int(self.tokens)}


def evaluate(objective: nn.Module, source: Source, eval_batches: list, cfg: TrainConfig,
             device: torch.device) -> dict | None:
    if not eval_batches:
        return None
    metrics = Metrics(cfg.objective.ttt_steps)
    objective.eval()
    rank, world = distributed.rank(), distributed.world_size()
    # Every rank runs the same number of forwards (sharded weights are gathered collectively); a rank
    # past the end repeats its last batch without counting it.
    rounds = -(-len(eval_batches) // world)
    with torch.no_grad(), _autocast(device):
        for r in range(rounds):
            i = r * world + rank
            batch = supervise(source, eval_batches[min(i, len(eval_batches) - 1)], cfg.data.pack, device)
            out = objective(batch)
            if i < len(eval_batches):
                metrics.add(out, batch.num_tokens)
    objective.train()
    metrics.all_reduce()
    return metrics.record()


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"torch_cuda_{i}"] = s
    return state


def _restore_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _check_run_dir(cfg: TrainConfig, run_json: dict) -> None:
    path = Path(cfg.runtime.output) / "run.json"
    latest = ckpt.latest_checkpoint(cfg.runtime.output)
    if latest is not None and not cfg.runtime.resume:
        raise ConfigError(f"{cfg.runtime.output} already holds checkpoints (latest {latest.name})",
                          "pass --resume to continue that run, or choose a new --output folder")
    if cfg.runtime.resume and path.is_file():
        before = json.loads(path.read_text())
        # an option newer than the run's spec_cli had its default value there
        defaults = {name: o.default for name, o in OPTIONS.items()}
        for key in sorted(set(before["options"]) | set(run_json["options"])):
            if key in RESUMABLE:
                continue
            if before["options"].get(key, defaults.get(key)) != run_json["options"].get(key):
                raise ConfigError(f"--resume with a different {key.replace('_', '-')}: the run used "
                                  f"{before['options'].get(key)!r}, now {run_json['options'].get(key)!r}",
                                  "resume with the run's options, or start a new run folder")
        for key, value in before["identity"].items():
            if run_json["identity"].get(key) != value:
                raise ArtifactError(f"--resume against a different {key.replace('_', ' ')}",
                                    "resume with the same target/cache and vocab map")


# ----------------------------------------------------------------------------- the loop

def run(cfg: TrainConfig, after_step=None) -> TrainResult:
    start_time = time.perf_counter()
    device = distributed.local_device(loading.choose_device(cfg.runtime.device))
    distributed.init(device)
    rank, world = distributed.rank(), distributed.world_size()
    torch.manual_seed(cfg.optim.seed)
    local.check_engine(cfg.runtime.target_engine)
    if cfg.runtime.target_engine != "transformers" and cfg.data.target is None:
        raise ConfigError(f"--target-engine {cfg.runtime.target_engine} runs a live --target in this process",
                          "drop --target-engine (a cache or a server decides), or train from --target")

    vocab_map = load_vocab_map(cfg.data.vocab_map)
    source = open_source(cfg, device, vocab_map)
    source.backend.set_vocab_mapping(vocab_map.selected_token_ids)
    train_batches, eval_batches = split_eval(source.plan, cfg.data.eval_fraction, cfg.optim.seed)
    if not train_batches:
        raise ConfigError("no training batches", "use more data or a smaller --eval-fraction")
    per_step = cfg.optim.grad_accum * world
    total_steps = cfg.optim.max_steps or max(1, int(cfg.optim.epochs * len(train_batches)) // per_step)

    algorithm = algorithms.get(cfg.draft.algorithm)
    if len(source.aux_layers) != algorithm.aux_layers:
        made = "the feature cache holds" if cfg.data.cache is not None else "the target serves"
        raise ConfigError(f"{made} {len(source.aux_layers)} aux layers {source.aux_layers}; {algorithm.name} "
                          f"reads {algorithm.aux_layers}",
                          f"make the supervision with --algorithm {algorithm.name} (`spec precompute` / "
                          "`spec serve-target`), or train the algorithm it was made for")
    target_config = loading.config_from_dict(source.target_config)
    draft_config = algorithm.config(
        target_config, vocab_map.draft_vocab_size, source.aux_layers,
        num_hidden_layers=cfg.draft.draft_layers, hidden_size=cfg.draft.draft_hidden_size,
        intermediate_size=cfg.draft.draft_intermediate_size, num_attention_heads=cfg.draft.draft_heads,
        num_key_value_heads=cfg.draft.draft_kv_heads, fc_norm=cfg.draft.fc_norm,
        norm_output=cfg.draft.norm_output,
        rope_theta=cfg.draft.draft_rope_theta,
        target_fingerprint=source.identity["target_fingerprint"],
        tokenizer_fingerprint=source.identity["tokenizer_fingerprint"],
        chat_template_sha256=source.chat_template.get("chat_template_sha256"),
        chat_template_source=source.chat_template.get("chat_template_source", ""),
        tokenizer_base_fingerprint=source.chat_template.get("tokenizer_base_fingerprint", ""),
        vocab_map_fingerprint=vocab_map.fingerprint, algorithm=algorithm.name)
    info(f"draft rope: {draft_config.rope_source}")
    draft = algorithm.build(draft_config)
    embed = source.backend.get_input_embeddings()
    draft.copy_embeddings(embed)
    # The frozen weights (copied from the target, never trained) are stored once per run, as the target
    # holds them (the draft's fp32 copy is an exact upcast); checkpoints leave them out.
    frozen = {"embed_tokens.weight": embed}
    frozen_record = {"keys": sorted(frozen), "fingerprint": ckpt.frozen_fingerprint(frozen)}
    draft.set_vocab_map(vocab_map.selected_token_ids)
    if cfg.draft.init_from_target:  # (a --resume then loads its checkpoint over it)
        head = source.backend.get_output_head()
        if head is None or not draft.init_from_target(head["lm_head_selected"], head.get("final_norm")):
            info("the draft's lm_head starts random: the target's output head is not available here "
                 "or does not fit the draft's hidden size")
    draft.to(device)
    units = []  # FSDP2 units (--fsdp under torchrun); else DDP replicates the draft
    if cfg.runtime.fsdp and world > 1:
        units = sharding.shard(draft)
    elif cfg.runtime.fsdp:
        info("--fsdp shards across torchrun processes; with one process it trains as usual")
    names = [n for n, p in draft.named_parameters() if p.requires_grad]
    params = [p for n, p in draft.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.optim.weight_decay)

    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.options().items()
               if k != "token"}  # a secret never goes to disk
    run_json = {"options": options, "identity": {**source.identity, "vocab_map_fingerprint":
                                                 vocab_map.fingerprint}}
    _check_run_dir(cfg, run_json)
    step = 0
    if cfg.runtime.resume and (latest := ckpt.latest_checkpoint(cfg.runtime.output)) is not None:
        parts = ckpt.load_checkpoint(latest)
        saved = (ckpt.checkpoint_meta(latest).get("frozen") or {}).get("fingerprint")
        if saved is not None and saved != frozen_record["fingerprint"]:
            raise ArtifactError(f"--resume with a different input embedding than the run trained with "
                                f"({latest} was saved with embedding {saved}, the target's is now "
                                f"{frozen_record['fingerprint']})",
                                "resume with the same target and --dtype, or start a new run folder")
        sharding.load_full_state(draft, optimizer, parts["model"],
                                 ckpt.unflatten_optimizer(parts["optimizer"],
                                                          parts["trainer_state"]["param_groups"], names),
                                 names, sharded=bool(units), frozen=parts["frozen_keys"])
        _restore_rng(parts["rng"])
        step = parts["trainer_state"]["step"]
        info(f"resuming from {latest} (step {step})")
    if rank == 0:
        Path(cfg.runtime.output).mkdir(parents=True, exist_ok=True)
        write_json(Path(cfg.runtime.output) / "run.json", run_json)
        ckpt.save_frozen(cfg.runtime.output, frozen, frozen_record["fingerprint"],
                         {"target_fingerprint": source.identity["target_fingerprint"]})
    del frozen, embed  # the draft holds its copy

    objective = algorithm.objective(draft, cfg.objective,
                                    activation_checkpointing=cfg.runtime.activation_checkpointing)
    model = objective
    if world > 1 and not units:
        model = nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None)

    def save(at_step: int) -> Path | None:
        model_state, optimizer_state = sharding.full_state(draft, optimizer, names, sharded=bool(units))
        if rank != 0:
            return None
        opt_tensors, groups = ckpt.flatten_optimizer(optimizer_state, names)
        epoch, _ = divmod(at_step * per_step, len(train_batches))
        return ckpt.save_checkpoint(
            cfg.runtime.output, at_step, model_state, opt_tensors, _rng_state(), draft_config.to_dict(),
            {"step": at_step, "epoch": epoch, "micro_batches_done": at_step * per_step,
             "total_steps": total_steps, "lr": lr_at(max(at_step - 1, 0), total_steps, cfg.optim),
             "param_groups": groups, "world_size": world, "grad_accum": cfg.optim.grad_accum,
             "parallel": "fsdp" if units else ("ddp" if world > 1 else "single")},
            keep_last=cfg.runtime.keep_last, frozen=frozen_record)

    # Supervision for this rank's i-th micro-batch (global number i * world + rank). With --stream,
    # producer threads make it ahead of time; else backends that can work asynchronously (remote)
    # get the next --prefetch batches in flight. Order does not change results: both are exact.
    pending: dict = {}
    can_submit = type(source.backend).submit is not TargetBackend.submit
    stream = None

    def indices_of(i: int) -> list[int]:
        return batch_at(train_batches, i * world + rank, cfg.optim.seed)[1]

    def next_batch(i: int):
        if stream is not None:
            return stream.get(i)
        if can_submit and cfg.runtime.prefetch > 0:
            for j in range(i, min(i + 1 + cfg.runtime.prefetch, total_steps * cfg.optim.grad_accum)):
                if j not in pending:
                    future = submit(source, indices_of(j), cfg.data.pack)
                    if future is None:
                        break
                    pending[j] = future
        future = pending.pop(i, None)
        if future is not None:
            return future.result().to(device)
        return supervise(source, indices_of(i), cfg.data.pack, device)

    logger = TrainLogger(cfg.runtime.output, total_steps, enabled=rank == 0, start_step=step, world=world)
    info(f"training: {len(train_batches)} train / {len(eval_batches)} eval batches, {total_steps} steps "
         f"of {per_step} micro-batch(es), TTT {cfg.objective.ttt_steps}, loss {cfg.objective.loss}, "
         f"device {device}"
         + (f", {'FSDP2' if units else 'DDP'} over {world} processes" if world > 1 else ""))
    window, window_start, last_saved = Metrics(cfg.objective.ttt_steps), time.perf_counter(), step
    loop_start, out_of_time = time.perf_counter(), False
    final_train = final_eval = stream_report = None
    try:
        if cfg.runtime.stream:
            stream = open_stream(cfg, source, indices_of, step * cfg.optim.grad_accum,
                                 total_steps * cfg.optim.grad_accum, device)
        while step < total_steps and not out_of_time:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, cfg.optim)
            step_tokens = 0
            for micro in range(cfg.optim.grad_accum):
                batch = next_batch(step * cfg.optim.grad_accum + micro)
                sync = micro == cfg.optim.grad_accum - 1 or world == 1
                ctx = _null() if sync else (sharding.no_gradient_sync(units) if units else model.no_sync())
                with ctx, _autocast(device):
                    out = model(batch)
                    (out.loss / cfg.optim.grad_accum).backward()  # each backward adds: average them
                window.add(out, batch.num_tokens)
                step_tokens += batch.num_tokens
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            logger.step(step_tokens)
            if after_step is not None:
                after_step(step)

            if cfg.optim.max_time is not None and not out_of_time and step < total_steps:
                out_of_time = distributed.any_rank(
                    time.perf_counter() - loop_start >= cfg.optim.max_time, device)
                if out_of_time:
                    info(f"--max-time {cfg.optim.max_time:g}s reached after step {step} of {total_steps}; "
                         f"saving (rerun with --resume to continue the schedule)")
            last = step == total_steps or out_of_time
            if step % cfg.runtime.log_every == 0 or last:
                window.all_reduce()
                elapsed = time.perf_counter() - window_start
                final_train = {"split": "train", "step": step, "lr": optimizer.param_groups[0]["lr"],
                               **window.record(), "tokens_per_s": float(window.tokens) / max(elapsed, 1e-9),
                               "steps_in_record": int(float(window.batches) / per_step) or 1}
                logger.log(final_train)
                window, window_start = Metrics(cfg.objective.ttt_steps), time.perf_counter()
            if (cfg.runtime.eval_every and step % cfg.runtime.eval_every == 0) or last:
                final_eval = evaluate(objective, source, eval_batches, cfg, device)
                if final_eval is not None:
                    logger.log({"split": "eval", "step": step, **final_eval})
            if step % cfg.runtime.save_every == 0 or last:
                save(step)
                last_saved = step
    except KeyboardInterrupt:
        if step > last_saved:  # keep the finished steps; `--resume` continues from here
            saved = save(step)
            if saved is not None:
                info(f"interrupted: saved {saved}; rerun with --resume to continue")
        raise
    finally:
        if stream is not None:  # stop the producers and free the store before the target goes
            stream.close()
            stream_report = stream.report()
            _save_stream_report(cfg, rank, stream_report)
        logger.close()
        source.backend.close()
    distributed.barrier()
    plot = plot_curves(cfg.runtime.output) if rank == 0 else None
    checkpoint_dir = ckpt.latest_checkpoint(cfg.runtime.output)
    distributed.shutdown()
    return TrainResult(Path(cfg.runtime.output), checkpoint_dir, step, time.perf_counter() - start_time,
                       final_train, final_eval, plot, total_steps, stream_report)


def _save_stream_report(cfg: TrainConfig, rank: int, report: dict) -> None:
    """stream.json in the run folder (rank 0; also after an error or Ctrl-C) and one log line."""
    info(f"stream: {report['produced']} batches produced, {report['consumed']} consumed, peak "
         f"{report['peak_bytes'] / 2**20:.1f} MiB in the store; the trainer waited "
         f"{report['trainer_wait_s']:.1f} s, producers {report['put_wait_s']:.1f} s on the bound")
    if rank == 0:
        try:
            write_json(Path(cfg.runtime.output) / "stream.json", report)
        except OSError as exc:  # never hide the error that ended the run
            info(f"could not write stream.json: {exc}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
