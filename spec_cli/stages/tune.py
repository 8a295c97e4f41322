"""`spec tune`: how to serve a draft on this machine, measured: the speculation length per batch size.

A draft that helps one request at a time can slow a busy server: verification makes every request's
forward longer, and at a large batch the target is no longer waiting on memory. vLLM takes a batch-size
schedule for the number of draft tokens (`speculative_config.num_speculative_tokens_per_batch_size`:
`[(first, last, k), ...]`, inclusive ranges, k 0 meaning no drafts at those sizes). This stage measures
the user's own draft on their own target and writes the schedule that was fastest.

vLLM (`--engine vllm`, the default): engines in this process, the target alone and the target with the
draft, started with the speculative config the export's own serve command gives (readme.speculative_config:
its method and keys such as P-EAGLE's parallel_drafting), num_speculative_tokens --max-k and a schedule. k
is set between measurements through the same lookup vLLM's scheduler reads for a schedule, so each k is
measured as a server started with that schedule runs it (the drafter proposes k tokens a step). For every
batch size b the same --requests prompts (MT-bench first turns by default; b of them when b is larger) are
sent in waves of b; output tokens / wall time of the waves is the throughput. Every configuration runs in
every repeat, in turn, so that a change in the machine's load hits all of them; each keeps its median and
its range.

A parallel drafter (P-EAGLE) proposes all of its engine's num_speculative_tokens in one forward or none
(vllm.drafts_all_at_once), so each k needs an engine started with it, and its schedule holds 0 and one k
(recommend_one_k). Each engine takes the GPU share vLLM gives one engine alone, so they load in turn, one
alive at a time (--max-k + 1 loads: k --max-k with k 0, then each smaller k, then the target alone), each
measured and closed before the next starts (_measure_in_turn). Within an engine the repeats run in turn as
above (k 0 and k --max-k side by side in theirs); across engines they do not: a change in the machine's
load between two engines' turns moves one's figures against the other's, which the busy meter, running
over all of them, is there to catch.

The recommendation at each batch size is the fastest measured k (k 0 included). A schedule is written
when some batch size is fastest with drafts, none at all when none is. It is refused as a recommendation
when the busy meter says the machine was too busy for the speeds to mean much. A fresh engine started
with the recommended config then decodes the prompts at every batch size, and its greedy outputs must
equal the target alone's.

`--engine torch`: spec_cli's PyTorch evaluator at batch 1 (it decodes one request): chains of 1..--max-k
and EAGLE-2 trees (vLLM serves chains only), the fastest recommended for `spec eval` / SGLang's
`--speculative-eagle-topk`. DFlash drafts are swept by how many of their block's tokens are drafted.

How long it takes depends on the machine: before the first engine loads it says the work (runs,
prompts, engine loads), and once the first run is timed how long the rest takes at that pace
(_Forecast).

Written to --output (default EXPORT-tune beside the export): serving.json, speedup.png.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spec_cli import assets, threads
from spec_cli.artifacts import outputs
from spec_cli.artifacts.io import SCHEMA_VERSION, write_json
from spec_cli.console import duration, info, progress, warn
from spec_cli.data import chat_templates
from spec_cli.draft import algorithms
from spec_cli.errors import ConfigError
from spec_cli.eval import drafts, prompts
from spec_cli.eval.speculative import Settings, eos_ids
from spec_cli.export import readme
from spec_cli.targets import loading

ENGINES = ("vllm", "torch")
BATCH_SIZES = (1, 2, 4, 8, 16)
TREES = (
    (2, 8),
    (4, 16),
)  # --engine torch: (top-k, nodes verified) of the EAGLE-2 trees swept at each depth
# vLLM's output tokens/s at batch size b over one request's: about b ** 0.7 (SmolLM2 on a CPU;
# docs/results.md); _Forecast scales the first run's pace by it, and `spec demo`'s clock its tune stage
BATCH_SPEED_POWER = 0.7


@dataclass
class TuneConfig:
    draft: (
        Path  # an export folder (or a run / checkpoint, exported for vLLM into a temporary folder)
    )
    target: str
    output: Path | None = None  # default: EXPORT-tune beside the export
    engine: str = "vllm"
    max_k: int | None = None  # default: 5 (a DFlash draft: its block size - 1)
    batch_sizes: tuple[int, ...] | None = (
        None  # None: BATCH_SIZES, those the engine's KV cache holds
    )
    prompts: str = "mt-bench"
    requests: int = 8  # prompts decoded at every batch size (b of them when b is larger)
    max_new_tokens: int = 64
    repeats: int = 3
    dtype: str | None = None
    device: str | None = None
    check_fingerprint: bool = True
    verify: bool = True  # start vLLM with the recommended config and check its greedy outputs
    # batch_sizes as a wish (spec demo): a size the engine's KV cache does not hold is left out, as the
    # default sizes are, instead of refused
    fit_sizes: bool = False


@dataclass
class Measured:
    """One configuration at one batch size: tokens/s of each repeat, and whether its outputs were the
    target alone's."""

    tokens_per_s: list[float] = field(default_factory=list)
    same: list[bool] = field(default_factory=list)
    acceptance_length: float | None = None  # --engine torch: the decoder's own count

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s) if self.tokens_per_s else 0.0


@dataclass
class TuneResult:
    output: Path
    json_path: Path
    plot_path: Path | None
    engine: str
    table: list[dict]
    recommended: dict | None  # the speculative_config (vLLM) or the decoding settings (torch)
    refused: str | None  # why nothing was recommended although measured
    serve: str
    verified: dict | None
    busy: dict
    seconds: float
    settings: dict = field(default_factory=dict)


def _work_text(cfg: TuneConfig, configs: str, n_configs: int, sizes: list[int], loads: str) -> str:
    """The measurements to come, said before the first engine loads: runs, prompts, engine loads."""
    runs = cfg.repeats * len(sizes) * n_configs
    prompts_per_run = f"{cfg.requests} prompts"
    if max(sizes) > cfg.requests:
        prompts_per_run += f" (b at a batch size b above {cfg.requests})"
    plural = lambda n: "s" if n > 1 else ""  # noqa: E731
    return (
        f"tune: {runs} runs ({n_configs} configurations: {configs}; "
        f"batch size{plural(len(sizes))} {','.join(map(str, sizes))}; "
        f"{cfg.repeats} repeat{plural(cfg.repeats)}), each decoding {prompts_per_run} of up to "
        f"{cfg.max_new_tokens} new tokens; {loads}. How long they take on this machine is said "
        "once the first run is timed"
    )


class _Forecast:
    """How long the rest of the measurements take, said once the first run is timed: every run
    decodes as many tokens per prompt as the first, at its pace scaled by BATCH_SPEED_POWER to each
    batch size; the engine loads still to come take what one took here; `verify`: the recommended
    config's check (two more loads, each batch size's prompts decoded twice) when there is a
    recommendation."""

    def __init__(self, cfg: TuneConfig, runs_per_size: int, verify: bool = False):
        self.cfg, self.runs_per_size, self.verify = cfg, runs_per_size, verify
        self.loads_left, self.load_seconds = 0, 0.0  # the callers measure the first load
        self.said = False

    def first_run(self, sizes: list[int], b: int, tokens: int, seconds: float) -> None:
        if self.said or tokens <= 0 or seconds <= 0:
            return
        self.said = True
        per_prompt = tokens / max(self.cfg.requests, b)
        alone = tokens / seconds / b**BATCH_SPEED_POWER  # one request's tokens/s

        def decode(size: int) -> float:  # one run's seconds at this batch size
            return max(self.cfg.requests, size) * per_prompt / (alone * size**BATCH_SPEED_POWER)

        every_size = sum(decode(size) for size in sizes)
        runs = self.runs_per_size * every_size - seconds
        loads = self.loads_left * self.load_seconds
        check = 2 * self.load_seconds + 2 * every_size if self.verify else 0.0
        why = []
        if len(sizes) > 1:
            why.append(f"batch size b decoding b^{BATCH_SPEED_POWER} times as fast")
        if self.loads_left:
            why.append(
                f"{self.loads_left} more engine load{'s' * (self.loads_left > 1)} of "
                f"{duration(self.load_seconds)} each, as one took"
            )
        if self.verify:
            why.append("2 more to check a recommendation")
        info(
            f"tune: the first run decoded {tokens} tokens in {seconds:.1f} s; at that pace the "
            f"rest takes about {duration(runs + loads + check)}"
            + (f" ({'; '.join(why)})" if why else "")
        )


def _check_output(cfg: TuneConfig, output: Path, own_places=()) -> None:
    """-o is a folder of spec tune's own (new, empty or an earlier tune), never the draft, the target, the
    prompts or a folder of another kind."""
    outputs.check(
        {"-o": (output, outputs.TUNE)},
        {"the draft": cfg.draft, "--target": cfg.target, "--prompts": cfg.prompts},
        own_places=own_places,
    )


def default_output(draft: Path) -> Path:
    draft = Path(draft)
    return draft.parent / f"{draft.name}-tune"


def schedule_for(best: dict[int, int]) -> list[list[int]]:
    """{batch size: fastest k} of the measured sizes -> vLLM's inclusive ranges: each measured size's k
    holds until the next measured size (vLLM carries the last range's k past its end)."""
    sizes = sorted(best)
    ranges: list[list[int]] = []
    for i, b in enumerate(sizes):
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else b
        first = 1 if i == 0 else b
        if ranges and ranges[-1][2] == best[b]:
            ranges[-1][1] = last
        else:
            ranges.append([first, last, best[b]])
    return ranges


def recommend_one_k(table: dict[int, dict[str, Measured]], lengths: list[int]) -> dict[int, str]:
    """A parallel drafter's schedule may hold only 0 and one k (the engine's num_speculative_tokens): for
    each k, the faster of k0 and k at every batch size; the k whose choices have the highest speed-up over
    the target alone, summed over the sizes (ties: the fewer draft tokens)."""

    def gain(best: dict[int, str]) -> float:
        return sum(
            table[b][c].median / table[b]["target"].median
            for b, c in best.items()
            if table[b]["target"].median
        )

    choices = [recommend(table, ["k0", f"k{k}"]) for k in lengths]
    return max(choices, key=gain)  # max keeps the first of equals: the fewest draft tokens


def recommend(table: dict[int, dict[str, Measured]], configs: list[str]) -> dict[int, str]:
    """Each batch size's fastest configuration by median tokens/s (ties: the first in `configs` order,
    the fewer draft tokens), among those whose greedy outputs were the target alone's in every round."""
    out = {}
    for b, row in table.items():
        exact = [c for c in configs if c in row and all(row[c].same)]
        if exact:
            out[b] = max(exact, key=lambda c: (row[c].median, -configs.index(c)))
    return out


def run(cfg: TuneConfig) -> TuneResult:
    start = time.perf_counter()
    if cfg.engine not in ENGINES:
        raise ConfigError(
            f"--engine {cfg.engine!r} is not one of {', '.join(ENGINES)}", "e.g. --engine vllm"
        )
    if (
        cfg.repeats < 1
        or cfg.requests < 1
        or cfg.max_new_tokens < 1
        or (cfg.max_k is not None and cfg.max_k < 1)
    ):
        raise ConfigError(
            "--repeats, --requests, --max-new-tokens and --max-k must be at least 1",
            "e.g. --repeats 3",
        )
    if cfg.batch_sizes is not None and (not cfg.batch_sizes or min(cfg.batch_sizes) < 1):
        raise ConfigError(
            "--batch-sizes must be whole numbers of at least 1", "e.g. --batch-sizes 1,2,4,8"
        )
    if cfg.output is not None:
        _check_output(cfg, Path(cfg.output))
    target_dir = loading.resolve_target(assets.resolve_target_arg(cfg.target))
    target_config = loading.load_config(target_dir)
    tokenizer = loading.load_tokenizer(target_dir, None)
    loaded = drafts.load_draft(Path(cfg.draft), target_config)
    drafts.check_target(loaded, target_dir, target_config, tokenizer, cfg.check_fingerprint)
    c = loaded.model.config
    algorithm = algorithms.get(c.algorithm)
    block = algorithm.eval_depth
    most = (
        int(block(c)) if block else None
    )  # a DFlash draft proposes at most its block size - 1 tokens
    max_k = cfg.max_k or (most or 5)
    if most is not None and max_k > most:
        raise ConfigError(
            f"--max-k {max_k}: this {algorithm.title} draft proposes at most {most} tokens per "
            "forward",
            f"use --max-k {most} or less",
        )
    conversations = prompts.load_conversations(cfg.prompts)
    ids = [prompts.prompt_ids(tokenizer, conv, 0) for conv in conversations if not conv.images]
    if not ids:
        raise ConfigError(
            f"--prompts {cfg.prompts} has no text prompt", "pass chat prompts without images"
        )
    stop = eos_ids(
        tokenizer, loading.generation_config(target_dir)
    ) | chat_templates.end_of_turn_ids(tokenizer, None)
    output = Path(cfg.output) if cfg.output else default_output(loaded.path)
    if cfg.output is None:  # beside the draft: its own place, even inside a run
        _check_output(cfg, output, own_places=[output])
    if cfg.engine == "torch":
        return _run_torch(cfg, loaded, target_dir, ids, stop, max_k, output, start)
    return _run_vllm(cfg, loaded, target_dir, ids, stop, max_k, output, start)


# ----------------------------------------------------------------------------- vLLM


def _run_vllm(
    cfg: TuneConfig,
    loaded,
    target_dir: Path,
    ids: list[list[int]],
    stop,
    max_k: int,
    output: Path,
    start: float,
) -> TuneResult:
    from spec_cli.engine import vllm

    vllm.require("spec tune")
    algorithm = algorithms.get(loaded.model.config.algorithm)
    fmt = algorithm.engine_format("vllm")
    if fmt is None:
        raise ConfigError(
            f"vLLM does not serve {algorithm.title} drafts", "tune it in PyTorch: --engine torch"
        )
    if loaded.kind == "export":  # served as its own README says: that format's speculative config
        own = next(
            (f for f in algorithm.formats if f.name == loaded.format and f.engine == "vllm"), None
        )
        if own is None:
            raise ConfigError(
                f"vLLM does not read a {loaded.format} export ({loaded.path})",
                f"pass a {fmt.name} export, or the run (exported for vLLM on the fly)",
            )
        fmt = own
    if vllm.cannot_run(fmt):
        raise ConfigError(
            f"spec tune cannot run {algorithm.title} drafts in vLLM here: {vllm.cannot_run(fmt)}",
            "tune it in PyTorch: --engine torch",
        )
    sizes = list(cfg.batch_sizes or BATCH_SIZES)
    biggest = max(sizes)
    device = loading.choose_device(cfg.device)
    dtype = loading.choose_dtype(cfg.dtype, device)
    longest = max(len(p) for p in ids[: max(cfg.requests, biggest)])
    length = min(
        loading.max_positions(loading.load_config(target_dir)),
        longest + cfg.max_new_tokens + max_k + 8,
    )
    if (
        cfg.batch_sizes is not None and not cfg.fit_sizes and device.type == "cpu"
    ):  # before a minute of loading
        _cpu_room_check(
            cfg,
            sizes,
            loading.load_config(target_dir),
            dtype,
            longest + cfg.max_new_tokens + max_k + 1,
        )
    with tempfile.TemporaryDirectory(prefix="spec-tune-") as tmp:
        folder = loaded.path
        if loaded.kind != "export":
            from spec_cli.stages import export

            info(f"exporting {loaded.path} for vLLM (fp32) into a temporary folder")
            folder = export.run(
                export.ExportConfig(
                    source=loaded.path,
                    format=fmt.name,
                    output=Path(tmp) / "draft",
                    dtype="fp32",
                    engine_check="none",
                    target=str(target_dir),
                )
            ).output
        measured = readme.speculative_config(
            fmt, folder, max_k
        )  # what the export's serve command runs
        # a parallel drafter drafts its engine's num_speculative_tokens or none: one engine per k
        one_k = vllm.drafts_all_at_once(measured)
        lengths = list(range(1, max_k + 1)) if one_k else [max_k]
        impl = readme.export_model_impl(folder)  # as the export's serve command runs it
        # one step of the biggest batch schedules biggest x (1 + max_k) tokens: room for it (vLLM's default
        # budget, 4096, is below max_num_seqs past 4096 requests and refuses to start)
        budget = max(4096, biggest * (max_k + 1))
        loads = max_k + 1 if one_k else len(lengths) + 1
        info(
            _work_text(
                cfg,
                f"the target alone and k 0-{max_k}",
                max_k + 2,
                sizes,
                f"{loads} engine loads"
                + (", 2 more to check a recommendation" if cfg.verify else ""),
            )
        )
        forecast = _Forecast(cfg, cfg.repeats * (max_k + 2), verify=cfg.verify)
        if one_k:  # one engine alive at a time: each takes the GPU share vLLM gives an engine alone
            info(
                f"a parallel drafter is tuned one engine per k, loaded in turn: {max_k + 1} loads of "
                f"{target_dir.name} in vLLM ({str(dtype).replace('torch.', '')}), one alive at a time (k {max_k} "
                f"and 0, "
                + "".join(f"k {k}, " for k in range(max_k - 1, 0, -1))
                + "the target alone"
                + (", 2 more to verify a recommendation" if cfg.verify else "")
                + f"); draft {folder}, "
                f"batches up to {biggest}"
            )

            def drafting(k):
                config = {
                    **readme.speculative_config(fmt, folder, k),
                    "num_speculative_tokens_per_batch_size": [[1, biggest, k]],
                }
                return lambda: _drafting_engine(
                    target_dir, config, algorithm, dtype, length, biggest, budget, impl
                )

            def alone():
                return vllm.Engine(
                    target_dir,
                    None,
                    dtype=dtype,
                    max_model_len=length,
                    max_num_seqs=biggest,
                    max_num_batched_tokens=budget,
                )

            turns = [
                (drafting(max_k), ["k0", f"k{max_k}"]),
                *((drafting(k), [f"k{k}"]) for k in range(max_k - 1, 0, -1)),
                (alone, ["target"]),
            ]
            configs = ["target"] + [f"k{k}" for k in range(max_k + 1)]
            sizes, table, busy = _measure_in_turn(
                cfg,
                sizes,
                configs,
                ids,
                stop,
                longest + cfg.max_new_tokens + max_k + 1,
                turns,
                forecast,
            )
        else:
            info(
                f"loading {target_dir.name} {len(lengths) + 1} times in vLLM ({str(dtype).replace('torch.', '')}): "
                f"alone, and with the draft {folder} (up to {max_k} draft tokens, batches up to {biggest})"
            )
            share = vllm.shared_gpu(len(lengths) + 1)  # the engines are held at once
            with contextlib.ExitStack() as engines:
                loading_start = time.perf_counter()
                base = engines.enter_context(
                    vllm.Engine(
                        target_dir,
                        None,
                        dtype=dtype,
                        max_model_len=length,
                        max_num_seqs=biggest,
                        max_num_batched_tokens=budget,
                        gpu_memory_utilization=share,
                    )
                )
                drafters = {}
                for k in lengths:
                    config = {
                        **readme.speculative_config(fmt, folder, k),
                        "num_speculative_tokens_per_batch_size": [[1, biggest, k]],
                    }
                    drafters[k] = engines.enter_context(
                        _drafting_engine(
                            target_dir,
                            config,
                            algorithm,
                            dtype,
                            length,
                            biggest,
                            budget,
                            impl,
                            share,
                        )
                    )
                forecast.load_seconds = (time.perf_counter() - loading_start) / loads  # one engine
                sizes = _held_sizes(
                    cfg, sizes, [base, *drafters.values()], longest + cfg.max_new_tokens + max_k + 1
                )
                for engine in (
                    base,
                    *drafters.values(),
                ):  # untimed: the engines' first steps (allocations, set-up)
                    _waves(engine, ids[: max(sizes)], max(sizes), min(8, cfg.max_new_tokens), stop)
                configs = ["target"] + [f"k{k}" for k in range(max_k + 1)]
                table, busy = _measure(cfg, sizes, configs, ids, stop, base, drafters, forecast)
        fastest = recommend(table, configs[1:])
        best = recommend_one_k(table, lengths) if one_k else fastest  # what a server can run
        refused = busy["warning"] if busy["too_busy"] else None
        recommended = None
        ks = {b: int(best[b][1:]) for b in best}
        if refused is None and any(ks.values()):
            recommended = {
                **readme.speculative_config(fmt, folder, max(ks.values())),
                "num_speculative_tokens_per_batch_size": schedule_for(ks),
            }
        verified = None
        if recommended is not None and cfg.verify:
            verified = _verify(
                cfg,
                target_dir,
                recommended,
                algorithm,
                dtype,
                length,
                sizes,
                ids,
                stop,
                biggest,
                impl,
            )
            if not verified["all_same"]:  # a config that changes greedy outputs is not one to serve
                differ = [b for b, same in verified["same_as_target"].items() if not same]
                refused = (
                    f"vLLM started with the recommended config decoded other greedy outputs than the "
                    f"target alone at batch size(s) {', '.join(differ)}"
                )
                recommended = None
    rows = _rows(table, configs, fastest)
    # a server started with a draft pays for the drafter's machinery even at k 0: where the target alone
    # was faster still, a server that sees mostly such batches is better off without speculation
    alone = {
        b: round(table[b]["target"].median / table[b][best[b]].median, 4)
        for b in best
        if table[b]["target"].median > table[b][best[b]].median
    }
    path = loaded.path if loaded.kind == "export" else Path("DRAFT")
    if recommended is not None:
        recommended["model"] = str(path)
    serve = _serve_command(target_dir, recommended, ks if refused is None else None, impl)
    return _write(
        cfg,
        output,
        "vllm",
        rows,
        recommended,
        refused,
        serve,
        verified,
        busy,
        start,
        loaded,
        {
            "batch_sizes": sizes,
            "max_k": max_k,
            "dtype": str(dtype).replace("torch.", ""),
            "max_model_len": length,
            "ks_fastest": {str(b): int(c[1:]) for b, c in fastest.items()},
            # the draft engines' speculative config, but for the k each drafted (engine_per_k: each k
            # in an engine started with it, as a parallel drafter must be)
            "draft_engine": {
                **{
                    key: v
                    for key, v in measured.items()
                    if key not in ("model", "num_speculative_tokens")
                },
                "engine_per_k": one_k,
            },
            "target_alone_faster": {str(b): r for b, r in alone.items()},
            # vLLM carries the last range's k up to its max_num_seqs: sizes past these were not measured
            "measured_up_to": max(sizes),
        },
    )


def _cpu_room_check(cfg: TuneConfig, sizes: list[int], config, dtype, per_request: int) -> None:
    """On a CPU vLLM's KV cache is VLLM_CPU_KVCACHE_SPACE GiB; the target's own layers alone bound what
    it holds (the draft's take more), so a batch size past that bound is refused before any engine
    loads. The exact check (`_held_sizes`) follows once they have."""
    from spec_cli.engine import vllm

    vllm.configure_env()
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * loading.num_layers(config) * heads * head_dim * torch.finfo(dtype).bits // 8
    try:
        room = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30) // per_token
    except (KeyError, ValueError):
        return
    too_big = [b for b in sizes if b * per_request > room]
    if too_big:
        raise ConfigError(
            f"--batch-sizes {','.join(map(str, too_big))}: vLLM's KV cache here "
            f"(VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB) holds at most {room} "
            f"tokens of this target, and {max(too_big)} requests of up to {per_request} tokens need "
            f"{max(too_big) * per_request}",
            "drop the larger sizes, or give vLLM more KV cache (VLLM_CPU_KVCACHE_SPACE in GiB)",
        )


def _held_sizes(cfg: TuneConfig, sizes: list[int], engines, per_request: int) -> list[int]:
    """The batch sizes all `engines`' KV caches hold (each request up to `per_request` tokens): a
    size asked for by --batch-sizes that does not fit is refused, the default ones are left out (said)."""
    capacity = min(
        (c for c in (e.kv_capacity_tokens() for e in engines) if c is not None), default=None
    )
    if capacity is None:
        return sizes
    block = max(getattr(e, "kv_block_tokens", lambda: 16)() for e in engines)
    per_request = -(-per_request // block) * block  # the cache is handed out in whole blocks
    fits = [b for b in sizes if b * per_request <= capacity]
    too_big = [b for b in sizes if b not in fits]
    if too_big and cfg.batch_sizes is not None and not cfg.fit_sizes:
        raise ConfigError(
            f"--batch-sizes {','.join(map(str, too_big))}: the engine's KV cache holds {capacity} "
            f"tokens here, and {max(too_big)} requests of up to {per_request} tokens need "
            f"{max(too_big) * per_request}",
            "drop the larger sizes, or give vLLM more KV cache "
            "(VLLM_CPU_KVCACHE_SPACE in GiB on a CPU)",
        )
    if too_big:
        info(
            f"batch sizes {', '.join(map(str, too_big))} left out: the KV cache holds {capacity} tokens here"
        )
    if not fits:
        raise ConfigError(
            f"not even one request of {per_request} tokens fits the engine's KV cache ({capacity})",
            "lower --max-new-tokens, or give vLLM more KV cache",
        )
    return fits


def _wave_prompts(ids: list[list[int]], requests: int, b: int) -> list[list[int]]:
    """The prompts decoded at batch size b: --requests of them, or b when b is larger."""
    n = max(requests, b)
    return [ids[i % len(ids)] for i in range(n)]


def _drafting_engine(
    target_dir: Path,
    config: dict,
    algorithm,
    dtype,
    length: int,
    biggest: int,
    budget: int,
    impl: str | None,
    share: float | None = None,
):
    """vLLM with the draft, started with `config` (a speculative config: method, model, the rest);
    share: its gpu_memory_utilization (None: vLLM's default, for an engine held alone)."""
    from spec_cli.engine import vllm

    options = {
        k: v for k, v in config.items() if k not in ("method", "model", "num_speculative_tokens")
    }
    return vllm.Engine(
        target_dir,
        Path(config["model"]),
        config["num_speculative_tokens"],
        dtype,
        length,
        method=config["method"],
        max_num_seqs=biggest,
        max_num_batched_tokens=budget,
        draft_class=algorithm.vllm_draft_class,
        speculative_options=options,
        model_impl=impl,
        gpu_memory_utilization=share,
    )


def _drafter(drafters: dict, k: int):
    """The engine that drafts k tokens, set to k: the one started with k (a parallel drafter runs only its
    own), else the one started with the most (k 0 too)."""
    engine = drafters.get(k) or drafters[max(drafters)]
    engine.set_speculative_tokens(k)
    return engine


def _measure(
    cfg: TuneConfig,
    sizes: list[int],
    configs: list[str],
    ids,
    stop,
    base,
    drafters: dict,
    forecast: _Forecast | None = None,
):
    """Every configuration at every batch size, `repeats` times, in turn -> ({b: {config: Measured}}, the
    busy meter's record). `drafters`: {num_speculative_tokens: engine}; `forecast`: told the first
    run."""
    table = {b: {c: Measured() for c in configs} for b in sizes}
    reference: dict[int, list[list[int]]] = {}
    meter = threads.Meter()
    with progress("tune", cfg.repeats * len(sizes) * len(configs), unit="runs") as bar:
        for _ in range(cfg.repeats):
            for b in sizes:
                batch = _wave_prompts(ids, cfg.requests, b)
                for c in configs:
                    engine = base if c == "target" else _drafter(drafters, int(c[1:]))
                    outputs, seconds = _waves(engine, batch, b, cfg.max_new_tokens, stop)
                    if c == "target":
                        reference.setdefault(b, outputs)
                    m = table[b][c]
                    m.tokens_per_s.append(sum(len(o) for o in outputs) / seconds)
                    m.same.append(outputs == reference.get(b))
                    bar.advance()
                    if forecast is not None:
                        forecast.first_run(sizes, b, sum(len(o) for o in outputs), seconds)
    busy = meter.stop(
        torch.get_num_threads(),
        threads.available_cores(),
        on_cpu=loading.choose_device(cfg.device).type == "cpu",
    )
    return table, busy


def _measure_in_turn(
    cfg: TuneConfig,
    sizes: list[int],
    configs: list[str],
    ids,
    stop,
    per_request: int,
    turns: list,
    forecast: _Forecast | None = None,
) -> tuple[list[int], dict, dict]:
    """`turns`: [(start an engine, the configs it measures)], one engine alive at a time: each starts, holds
    its batch sizes, warms up (untimed), measures its configs at every size `repeats` times in turn, and
    closes before the next starts. -> (the sizes every engine held, {b: {config: Measured}}, the busy
    meter's record over all turns). Outputs are kept and compared with the target alone's first round at
    the end, whichever turn measured the target. `forecast`: told the first engine's load time and
    the first run."""
    table = {b: {c: Measured() for c in configs} for b in sizes}
    outputs: dict[int, dict[str, list]] = {b: {c: [] for c in configs} for b in sizes}
    meter = threads.Meter()
    with progress("tune", cfg.repeats * len(sizes) * len(configs), unit="runs") as bar:
        for turn, (start_engine, measures) in enumerate(turns):
            loading_start = time.perf_counter()
            with start_engine() as engine:
                if turn == 0 and forecast is not None:
                    forecast.load_seconds = time.perf_counter() - loading_start
                    forecast.loads_left = len(turns) - 1
                held = _held_sizes(cfg, sizes, [engine], per_request)
                for b in set(sizes) - set(
                    held
                ):  # an earlier engine's figures at a size this one cannot hold
                    del table[b], outputs[b]
                sizes = held
                _waves(
                    engine, ids[: max(sizes)], max(sizes), min(8, cfg.max_new_tokens), stop
                )  # untimed first steps
                for _ in range(cfg.repeats):
                    for b in sizes:
                        batch = _wave_prompts(ids, cfg.requests, b)
                        for c in measures:
                            if c != "target":
                                engine.set_speculative_tokens(int(c[1:]))
                            out, seconds = _waves(engine, batch, b, cfg.max_new_tokens, stop)
                            table[b][c].tokens_per_s.append(sum(len(o) for o in out) / seconds)
                            outputs[b][c].append(out)
                            bar.advance()
                            if forecast is not None:
                                forecast.first_run(sizes, b, sum(len(o) for o in out), seconds)
    for b in sizes:
        reference = outputs[b]["target"][0]
        for c in configs:
            table[b][c].same = [out == reference for out in outputs[b][c]]
    busy = meter.stop(
        torch.get_num_threads(),
        threads.available_cores(),
        on_cpu=loading.choose_device(cfg.device).type == "cpu",
    )
    return sizes, table, busy


def _waves(
    engine, batch: list[list[int]], b: int, max_new_tokens: int, stop
) -> tuple[list[list[int]], float]:
    """`batch` decoded b at a time (one generate call per wave: vLLM runs its requests together) -> the
    outputs in order and the wall time of all waves."""
    outputs, start = [], time.perf_counter()
    for i in range(0, len(batch), b):
        wave = batch[i : i + b]
        outputs += engine.generate_batch(wave, [max_new_tokens] * len(wave), eos_ids=stop)
    return outputs, time.perf_counter() - start


def _verify(
    cfg, target_dir, recommended, algorithm, dtype, length, sizes, ids, stop, biggest, impl
) -> dict:
    """A fresh engine started with the recommended speculative_config decodes every batch size's prompts:
    its greedy outputs against the target alone's (decoded again, in its own fresh engine)."""
    from spec_cli.engine import vllm

    alone: dict[int, list] = {}
    budget = max(4096, biggest * (recommended["num_speculative_tokens"] + 1))
    with vllm.Engine(
        target_dir,
        None,
        dtype=dtype,
        max_model_len=length,
        max_num_seqs=biggest,
        max_num_batched_tokens=budget,
    ) as base:
        for b in sizes:
            alone[b] = _waves(
                base, _wave_prompts(ids, cfg.requests, b), b, cfg.max_new_tokens, stop
            )[0]
    same = {}
    with _drafting_engine(
        target_dir, recommended, algorithm, dtype, length, biggest, budget, impl
    ) as served:
        for b in sizes:
            same[str(b)] = (
                _waves(served, _wave_prompts(ids, cfg.requests, b), b, cfg.max_new_tokens, stop)[0]
                == alone[b]
            )
    return {"same_as_target": same, "all_same": all(same.values())}


def _rows(
    table: dict[int, dict[str, Measured]], configs: list[str], best: dict[int, str]
) -> list[dict]:
    rows = []
    for b, row in table.items():
        base = row["target"].median
        for c in configs:
            m = row[c]
            rows.append(
                {
                    "batch_size": b,
                    "config": c,
                    "k": int(c[1:]) if c[:1] == "k" and c[1:].isdigit() else None,
                    "tokens_per_s": round(m.median, 2),
                    "tokens_per_s_runs": [round(t, 2) for t in m.tokens_per_s],
                    "speedup": round(m.median / base, 4) if base else None,
                    "speedup_range": [
                        round(min(m.tokens_per_s) / base, 4),
                        round(max(m.tokens_per_s) / base, 4),
                    ]
                    if base
                    else None,
                    "same_as_target": all(m.same),
                    "fastest": best.get(b) == c,
                }
            )
    return rows


def _serve_command(
    target_dir: Path, recommended: dict | None, ks: dict | None, impl: str | None = None
) -> str:
    """impl: vLLM's --model-impl, as the export's own serve command gives it (readme.model_impl)."""
    import json

    if recommended is None:
        return (
            f"vllm serve {shlex.quote(str(target_dir))}  # no speculative decoding: no batch size measured "
            "faster with this draft"
            if ks is not None
            else ""
        )
    return (
        f"vllm serve {shlex.quote(str(target_dir))}"
        + (f" --model-impl {impl}" if impl else "")
        + f" --speculative-config {shlex.quote(json.dumps(recommended))}"
    )


# ----------------------------------------------------------------------------- PyTorch (batch 1)


def _run_torch(
    cfg: TuneConfig, loaded, target_dir: Path, ids, stop, max_k: int, output: Path, start: float
) -> TuneResult:
    from spec_cli.eval.session import TorchSession
    from spec_cli.eval.target import TREE_ATTENTION
    from spec_cli.stages.eval import WARMUP_TOKENS

    if cfg.batch_sizes not in (None, (1,)):
        raise ConfigError(
            "--engine torch decodes one request at a time (batch size 1)",
            "drop --batch-sizes, or tune in vLLM (--engine vllm)",
        )
    device = loading.choose_device(cfg.device)
    dtype = loading.choose_dtype(cfg.dtype, device)
    algorithm = algorithms.get(loaded.model.config.algorithm)
    shapes = [("target", 0, 1, 0)] + [(f"chain {k}", k, 1, k) for k in range(1, max_k + 1)]
    if not algorithm.eval_depth:  # a block drafter proposes a chain; the others can branch
        shapes += [(f"tree {d}x{t}/{n}", d, t, n) for d in range(2, max_k + 1) for t, n in TREES]
    trees = len(shapes) > max_k + 1
    configs = f"the target alone, chains 1-{max_k}" + (" and trees" if trees else "")
    info(
        _work_text(
            cfg,
            configs,
            len(shapes),
            [1],
            "the target and the draft load once in PyTorch"
            + (" (trees only where the target's attention takes them)" if trees else ""),
        )
    )
    session = TorchSession(target_dir, device, dtype)
    try:
        base_settings = Settings(
            depth=1,
            topk=1,
            num_tokens=1,
            temperature=0.0,
            max_new_tokens=cfg.max_new_tokens,
            eos_ids=stop,
        )
        spec, base = session.decoders(loaded, base_settings)
        if session.target.attn_implementation not in TREE_ATTENTION:
            shapes = [s for s in shapes if s[2] == 1]
        batch = ids[: cfg.requests]
        warm = replace(base_settings, max_new_tokens=min(WARMUP_TOKENS, cfg.max_new_tokens))
        base(
            batch[0], None, warm
        )  # untimed: allocations and lazy set-up, the target's and the draft's
        spec(batch[0], None, replace(warm, depth=max_k, num_tokens=max_k))
        table = {1: {name: Measured() for name, *_ in shapes}}
        reference = None
        meter = threads.Meter()
        forecast = _Forecast(cfg, cfg.repeats * len(shapes))
        with progress("tune", cfg.repeats * len(shapes), unit="runs") as bar:
            for _ in range(cfg.repeats):
                for name, depth, topk, nodes in shapes:
                    settings = replace(
                        base_settings, depth=max(depth, 1), topk=topk, num_tokens=max(nodes, 1)
                    )
                    decode = base if name == "target" else spec
                    t0, tokens, steps, produced = time.perf_counter(), [], 0, 0
                    for p in batch:
                        g = decode(p, None, settings)
                        tokens.append(g.tokens)
                        steps += len(g.steps)
                        produced += sum(m + 1 for m, _ in g.steps)
                    seconds = time.perf_counter() - t0
                    reference = tokens if name == "target" else reference
                    m = table[1][name]
                    m.tokens_per_s.append(sum(len(t) for t in tokens) / seconds)
                    m.same.append(tokens == reference)
                    m.acceptance_length = produced / steps if steps else None
                    bar.advance()
                    forecast.first_run([1], 1, sum(len(t) for t in tokens), seconds)
        busy = meter.stop(
            torch.get_num_threads(), threads.available_cores(), on_cpu=device.type == "cpu"
        )
    finally:
        session.close()
    names = [name for name, *_ in shapes]
    best = recommend(table, names)
    rows = _rows(table, names, best)
    for row in rows:
        row["acceptance_length"] = table[1][row["config"]].acceptance_length
        shape = next(s for s in shapes if s[0] == row["config"])
        row.update(depth=shape[1], topk=shape[2], num_tokens=shape[3])
    refused = busy["warning"] if busy["too_busy"] else None
    fastest = next(s for s in shapes if s[0] == best[1])
    recommended = None
    if refused is None and fastest[0] != "target":
        recommended = {"depth": fastest[1], "topk": fastest[2], "num_tokens": fastest[3]}
    serve = ""
    if recommended is not None:
        serve = (
            f"spec eval -t {shlex.quote(str(target_dir))} --draft {shlex.quote(str(loaded.path))} --depth "
            f"{fastest[1]}"
            + (f" --topk {fastest[2]} --num-tokens {fastest[3]}" if fastest[2] > 1 else "")
        )
        if fastest[2] > 1:
            serve += (
                f"   # SGLang: --speculative-num-steps {fastest[1]} --speculative-eagle-topk {fastest[2]} "
                f"--speculative-num-draft-tokens {fastest[3]}"
            )
    return _write(
        cfg,
        output,
        "torch",
        rows,
        recommended,
        refused,
        serve,
        None,
        busy,
        start,
        loaded,
        {
            "batch_sizes": [1],
            "max_k": max_k,
            "dtype": str(dtype).replace("torch.", ""),
            "fastest": fastest[0],
        },
    )


# ----------------------------------------------------------------------------- output


def _write(
    cfg: TuneConfig,
    output: Path,
    engine: str,
    rows: list[dict],
    recommended,
    refused,
    serve,
    verified,
    busy,
    start: float,
    loaded,
    settings: dict,
) -> TuneResult:
    from spec_cli import __version__

    output.mkdir(parents=True, exist_ok=True)
    json_path = output / "serving.json"
    key = "speculative_config" if engine == "vllm" else "decoding"
    why = (
        ("refused: " + refused)
        if refused
        else (
            "the fastest measured configuration at each batch size"
            if recommended is not None
            else "no configuration with drafts was faster than none at any batch size measured"
        )
    )
    write_json(
        json_path,
        {
            "kind": "serving",
            "schema_version": SCHEMA_VERSION,
            "version": __version__,
            "engine": engine,
            "draft": {
                "path": str(loaded.path),
                "kind": loaded.kind,
                "format": loaded.format,
                "step": loaded.step,
            },
            "target": str(cfg.target),
            key: recommended,
            "why": why,
            "serve": serve,
            "verified": verified,
            "settings": {
                **settings,
                "prompts": cfg.prompts,
                "requests": cfg.requests,
                "max_new_tokens": cfg.max_new_tokens,
                "repeats": cfg.repeats,
                "batch_sizes_asked": None if cfg.batch_sizes is None else list(cfg.batch_sizes),
            },
            "table": rows,
            "busy": busy,
        },
    )
    plot = plot_speedup(
        output / "speedup.png",
        rows,
        f"{loaded.path.name}: speed-up over the target alone ({engine})",
    )
    return TuneResult(
        output,
        json_path,
        plot,
        engine,
        rows,
        recommended,
        refused,
        serve,
        verified,
        busy,
        time.perf_counter() - start,
        settings,
    )


def plot_speedup(path: Path, rows: list[dict], title: str) -> Path:
    """speedup.png: speed-up over the target alone against batch size, one line per configuration (a bar
    chart of the configurations at batch size 1 when only that was measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows if r["config"] != "target"))
    sizes = sorted({r["batch_size"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    if len(sizes) == 1:
        values = [next(r["speedup"] for r in rows if r["config"] == c) for c in configs]
        ax.bar(range(len(configs)), values, color="#4c72b0")
        ax.set_xticks(range(len(configs)), configs, rotation=45, ha="right", fontsize=7)
    else:
        for c in configs:
            points = [(r["batch_size"], r["speedup"]) for r in rows if r["config"] == c]
            ax.plot(
                [b for b, _ in points], [s for _, s in points], "o-", label=c.replace("k", "k = ")
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (concurrent requests)")
        ax.legend(fontsize=7)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_ylabel("tokens/s over the target alone")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_tune(result: TuneResult) -> None:
    """The table (tokens/s and speed-up per configuration and batch size, the fastest in bold), the
    recommendation and the serve command."""
    from rich.table import Table

    from spec_cli.console import console, is_quiet, summary

    if is_quiet():
        return
    configs = list(dict.fromkeys(r["config"] for r in result.table))
    sizes = sorted({r["batch_size"] for r in result.table})
    table = Table(
        title=f"spec tune ({result.engine}): output tokens/s (speed-up over the target alone)",
        title_justify="left",
    )
    table.add_column("batch" if result.engine == "vllm" else "config", justify="right")
    columns = configs if result.engine == "vllm" else [f"batch {b}" for b in sizes]
    for c in columns:
        table.add_column(
            c if result.engine != "vllm" else ("target alone" if c == "target" else f"k = {c[1:]}"),
            justify="right",
        )
    if result.engine == "vllm":
        for b in sizes:
            cells = []
            for c in configs:
                r = next(r for r in result.table if r["batch_size"] == b and r["config"] == c)
                text = f"{r['tokens_per_s']:.1f}" + (
                    "" if c == "target" else f" ({r['speedup']:.2f}x)"
                )
                if not r["same_as_target"]:
                    text += " !"
                cells.append(f"[bold]{text}[/bold]" if r["fastest"] else text)
            table.add_row(str(b), *cells)
    else:
        for r in result.table:
            al = f", AL {r['acceptance_length']:.2f}" if r.get("acceptance_length") else ""
            text = f"{r['tokens_per_s']:.1f} ({r['speedup']:.2f}x{al})"
            table.add_row(r["config"], f"[bold]{text}[/bold]" if r["fastest"] else text)
    console.print(table)
    rows = [("written", f"{result.json_path}, {result.plot_path}")]
    if result.refused:
        warn(f"no recommendation: {result.refused}")
        rows.append(("recommended", "none: the machine was too busy (see above)"))
    elif result.recommended is None:
        rows.append(
            ("recommended", "no speculative decoding: nothing with drafts was faster at any size")
        )
    else:
        rows.append(("recommended", _recommended_text(result)))
    if result.verified is not None:
        rows.append(
            (
                "verified",
                "greedy outputs identical to the target alone's at every batch size"
                if result.verified["all_same"]
                else f"outputs differ from the target alone's at sizes "
                f"{[b for b, same in result.verified['same_as_target'].items() if not same]}",
            )
        )
    alone = result.settings.get("target_alone_faster") or {}
    if alone:
        rows.append(
            (
                "without a draft",
                "the target alone (no speculative_config) was faster still at batch "
                + ", ".join(f"{b} ({r:.2f}x the best k)" for b, r in alone.items())
                + ": a server that mostly sees such batches is better off without speculation",
            )
        )
    if result.recommended is not None and result.engine == "vllm":
        last = result.recommended["num_speculative_tokens_per_batch_size"][-1]
        if last[2]:
            rows.append(
                (
                    f"above batch {last[1]}",
                    f"not measured: vLLM keeps k {last[2]} up to its "
                    "max_num_seqs; tune with larger --batch-sizes if your server runs bigger batches",
                )
            )
    if result.serve:
        rows.append(("serve", result.serve))
    rows.append(("time", f"{result.seconds / 60:.1f} min"))
    summary("tune", rows)


def _recommended_text(result: TuneResult) -> str:
    r = result.recommended
    if result.engine == "vllm":
        parts = [
            f"{a}-{b}: k {k}" if a != b else f"{a}: k {k}"
            for a, b, k in r["num_speculative_tokens_per_batch_size"]
        ]
        return (
            "num_speculative_tokens_per_batch_size "
            + ", ".join(parts)
            + " (the last k holds above)"
        )
    return (
        f"chain of {r['depth']}"
        if r["topk"] == 1
        else f"tree depth {r['depth']}, top-{r['topk']}, {r['num_tokens']} nodes"
    )


def fastest_k(rows: list[dict]) -> dict[int, int]:
    """{batch size: the fastest k} from a serving.json table (k 0: no drafts)."""
    return {r["batch_size"]: r["k"] for r in rows if r["fastest"] and r["k"] is not None}
