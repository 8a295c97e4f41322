"""`spec eval`: real speculative decoding of the target with a draft, on MT-bench or chat prompts.

`--engine torch` (default) runs spec_cli's own decoder (chain or EAGLE-2 tree); `--engine vllm` runs the
same prompts and settings inside vLLM (`spec_cli.engine.vllm`): one engine with the draft and one
without, side by side in this process, acceptance read from vLLM's own per-request counters. A run or
checkpoint is exported for vLLM (fp32, into a temporary folder) first.

For every user turn the speculative decoder and the target alone (plain decoding with its KV cache)
answer the same prompt, one after the other, so machine load hits both alike; with --timing-repeats R
each does so R times, alternating (same seeds, so the same output), and each turn keeps its median
time. Turn j of a conversation is asked after the speculative decoder's own answer to turn j-1 (under
greedy it is also the target's).

Fair timing without knowing the trick: the intra-op thread count is chosen for the run (spec_cli.threads:
the cores other processes are not busy on; --threads overrides) and recorded, and the run measures how
much CPU it got and how busy the neighbours were: a figure from a crowded machine is reported with a
WARNING rather than trusted.

Sampling (--temperature > 0) keeps the target's distribution whichever way the draft proposes, but the
acceptance depends on it: --draft-sampling greedy (default) proposes the draft's argmax and accepts it
with probability p_target(token), which is what vLLM serves by default (draft_sample_method "greedy");
`sampled` draws from the draft's q and accepts with min(1, p/q) (vLLM's "probabilistic"). eval.json's
settings name the rule each engine ran (draft_sampling, acceptance_rule: speculative.ACCEPTANCE_RULES).

Written to --output: eval.json (settings incl. threads and the decoding rule, overall and per-category
numbers with the spread of the per-turn speed-ups, "busy"), outputs.jsonl (each answer, its acceptance
and its timings) and acceptance.png (acceptance rate by draft position). outputs.jsonl is rewritten
(atomically) after every turn, so a turn that fails leaves the finished ones there, and the error names
the prompt and turn; eval.json and acceptance.png come at the end (a folder without eval.json is an
interrupted run).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spec_cli import __version__, assets, threads
from spec_cli.artifacts import outputs
from spec_cli.artifacts.checkpoint import choice_note
from spec_cli.artifacts.io import SCHEMA_VERSION, atomic_path, write_json
from spec_cli.console import info, progress
from spec_cli.data import chat_templates
from spec_cli.draft import algorithms
from spec_cli.errors import ConfigError, SpecError
from spec_cli.eval import drafts, prompts
from spec_cli.eval.report import Tally, fastest_depth, parting, plot_acceptance, turn_speedup
from spec_cli.eval.session import TorchSession, VllmSession
from spec_cli.eval.speculative import DRAFT_SAMPLING, Generation, Settings, decoding_rule, eos_ids
from spec_cli.eval.target import TREE_ATTENTION
from spec_cli.targets import loading

WARMUP_TOKENS = 8  # one untimed generation of each decoder first (allocator, kernels, lazy init)
ENGINES = ("torch", "vllm")

# (prompt ids, seed or None[, settings]) -> Generation; one for the speculative decoder, one for the
# target alone (settings default to the run's; the warm-up passes shorter ones)
Decoder = Callable[..., Generation]


@dataclass
class EvalConfig:
    target: str
    draft: Path  # run folder, checkpoint folder or export folder
    prompts: str = "mt-bench"  # `mt-bench` or a chat data file
    output: Path | None = None  # default: beside the draft (see default_output)
    depth: int | None = (
        None  # draft tokens per verification (tree: depth); None: the draft's (natural_depth)
    )
    topk: int = 1  # 1: chain; > 1: EAGLE-2 tree
    num_tokens: int | None = (
        None  # tree nodes verified per step (default 16, at most all candidates)
    )
    temperature: float = 0.0  # 0: greedy
    draft_sampling: str = (
        "greedy"  # temperature > 0: argmax drafts (q one-hot, vLLM's default) or "sampled" from q
    )
    adaptive_verification: float = (
        0.0  # > 0: verify while the confidence head's survival is at least this
    )
    max_new_tokens: int = 256
    num_prompts: int | None = None  # default: all
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    check_fingerprint: bool = True
    engine: str = "torch"  # torch: spec_cli's decoder; vllm: inside vLLM
    threads: int | None = None  # intra-op threads; None: auto (spec_cli.threads.choose)
    timing_repeats: int = (
        1  # times each decoder answers each turn (alternating); the median is kept
    )
    chat_template: str | None = None  # a Jinja file or a family name; None: the target's own
    compare_depths: (
        tuple[int, ...] | str
    ) = ()  # chains also decoded in the same run, against the same
    # baseline; "auto": the shorter chains whose verification this machine runs measurably cheaper


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
    engine: str = "torch"
    busy: dict | None = None  # spec_cli.threads.Meter.stop: how much of the machine the timing got
    depths: dict[int, dict] | None = (
        None  # with --compare-depths: each chain depth's overall metrics
    )


def tree_size(depth: int, topk: int, num_tokens: int | None) -> int:
    """Nodes a tree verifies: --num-tokens (default 16), at most the k + (depth-1)*k^2 candidates."""
    candidates = topk + (depth - 1) * topk * topk
    return min(num_tokens or 16, candidates)


def _check_output(cfg: EvalConfig, output: Path | None) -> None:
    """-o is a folder of spec eval's own (new, empty or an earlier eval), never the draft, the target, the
    prompts or a folder of another kind; RUN/eval is where a run keeps its evaluations."""
    run = next(
        (p for p in (Path(cfg.draft), *Path(cfg.draft).parents[:2]) if (p / "run.json").is_file()),
        None,
    )
    outputs.check(
        {"-o": (output, outputs.EVAL)},
        {
            "--draft": cfg.draft,
            "--target": cfg.target,
            "--prompts": cfg.prompts,
            "--chat-template": cfg.chat_template,
        },
        own_places=[run / "eval"] if run is not None else [],
    )


def default_output(draft: drafts.LoadedDraft) -> Path:
    """Beside the draft: RUN/eval/step-N for a checkpoint of a run, EXPORT-eval for an export (the export
    folder stays exactly what the engine loads)."""
    if draft.kind == "export":
        return draft.path.parent / f"{draft.path.name}-eval"
    if draft.run_dir is not None:
        return draft.run_dir / "eval" / draft.path.name
    return draft.path / "eval"


DEFAULT_DEPTH = (
    3  # a chain of 3: SGLang's usual EAGLE-3 setting, and what the exports' READMEs serve
)


def natural_depth(config) -> int:
    """--depth when none is given: the algorithm's (Algorithm.eval_depth(config): DFlash proposes
    block_size - 1 tokens per forward), else a chain of 3."""
    rule = algorithms.get(config.algorithm).eval_depth
    return int(rule(config)) if rule else DEFAULT_DEPTH


def _validate(cfg: EvalConfig) -> None:
    if (cfg.depth is not None and cfg.depth < 1) or cfg.topk < 1 or cfg.max_new_tokens < 1:
        raise ConfigError(
            "--depth, --topk and --max-new-tokens must be at least 1", "e.g. --depth 3 --topk 1"
        )
    if cfg.temperature < 0:
        raise ConfigError(f"--temperature {cfg.temperature} is negative", "use 0 (greedy) or more")
    if cfg.num_tokens is not None and cfg.topk == 1:
        raise ConfigError(
            "--num-tokens sizes a tree (--topk 2 or more); a chain verifies --depth tokens",
            "drop --num-tokens, or add --topk",
        )
    if cfg.timing_repeats < 1 or (cfg.threads is not None and cfg.threads < 1):
        raise ConfigError(
            "--timing-repeats and --threads must be at least 1", "e.g. --timing-repeats 3"
        )
    if cfg.num_tokens is not None and cfg.num_tokens < 1:
        raise ConfigError("--num-tokens must be at least 1", "e.g. --num-tokens 16")
    if cfg.engine not in ENGINES:
        raise ConfigError(
            f"--engine {cfg.engine!r} is not one of {', '.join(ENGINES)}", "e.g. --engine vllm"
        )
    if cfg.draft_sampling not in DRAFT_SAMPLING:
        raise ConfigError(
            f"--draft-sampling {cfg.draft_sampling!r} is not one of {', '.join(DRAFT_SAMPLING)}",
            "greedy: the draft's argmax (vLLM's default); sampled: drawn from its distribution",
        )
    if cfg.draft_sampling == "sampled" and cfg.topk > 1:
        raise ConfigError(
            "--draft-sampling sampled draws a chain; an EAGLE-2 tree's nodes are the draft's top-k",
            "use --topk 1, or --draft-sampling greedy for a tree",
        )
    if cfg.compare_depths:
        if cfg.compare_depths != AUTO and min(cfg.compare_depths) < 1:
            raise ConfigError(
                f"--compare-depths {','.join(map(str, cfg.compare_depths))}: a depth is at least 1",
                "e.g. --compare-depths 1,2",
            )
        if cfg.topk > 1:
            raise ConfigError(
                "--compare-depths compares chains; an EAGLE-2 tree's size depends on its depth, "
                "top-k and node count together",
                "use --topk 1, or run one tree per spec eval",
            )
        if cfg.engine == "vllm":
            raise ConfigError(
                "--compare-depths runs in PyTorch only: vLLM fixes num_speculative_tokens when "
                "its engine starts",
                "run spec eval --engine vllm once per --depth",
            )
    if cfg.engine == "vllm" and cfg.topk > 1:
        raise ConfigError(
            "vLLM serves drafts as a chain of num_speculative_tokens here, not an EAGLE-2 tree",
            "use --topk 1 with --engine vllm (or --engine torch for trees)",
        )


def run(cfg: EvalConfig) -> EvalResult:
    start = time.perf_counter()
    _validate(cfg)
    _check_output(cfg, cfg.output)
    target_dir = loading.resolve_target(assets.resolve_target_arg(cfg.target))
    target_config = loading.load_config(target_dir)
    template = chat_templates.resolve(cfg.chat_template)
    tokenizer = loading.load_tokenizer(target_dir, template)
    note = choice_note(cfg.draft) if Path(cfg.draft).is_dir() else None
    if note:  # a run that kept RUN/best: say that it is evaluated, not the latest checkpoint
        info(note)
    loaded = drafts.load_draft(Path(cfg.draft), target_config)
    drafts.check_target(
        loaded, target_dir, target_config, tokenizer, cfg.check_fingerprint, template
    )
    c = loaded.model.config
    if cfg.depth is None:
        cfg = replace(cfg, depth=natural_depth(c))
    listed = () if cfg.compare_depths == AUTO else cfg.compare_depths
    compared = [
        d for d in dict.fromkeys(listed) if d != cfg.depth
    ]  # auto: chosen once the target is timed
    rule = algorithms.get(c.algorithm).eval_depth
    if compared and rule and max(compared) > int(rule(c)):
        raise ConfigError(
            f"--compare-depths {max(compared)}: this {algorithms.get(c.algorithm).title} draft "
            f"proposes at most {int(rule(c))} tokens per forward",
            f"compare depths up to {int(rule(c))}",
        )
    if cfg.adaptive_verification and not c.extra.get("confidence_head"):
        raise ConfigError(
            f"--adaptive-verification reads the draft's confidence head, and this "
            f"{algorithms.get(c.algorithm).title} draft has none",
            "train a DSpark draft with --confidence-head, or drop --adaptive-verification",
        )
    if cfg.adaptive_verification and cfg.engine == "vllm":
        raise ConfigError(
            "--adaptive-verification is the PyTorch evaluator's (vLLM's runs in its V2 runner with "
            "CUDA graphs)",
            "pass --engine torch",
        )
    if cfg.topk > c.draft_vocab_size:
        raise ConfigError(
            f"--topk {cfg.topk} exceeds the draft vocabulary ({c.draft_vocab_size})",
            "use a smaller --topk",
        )
    vllm_formats = [f.name for f in algorithms.get(c.algorithm).formats if f.engine == "vllm"]
    if cfg.engine == "vllm" and not vllm_formats:
        title = algorithms.get(c.algorithm).title
        raise ConfigError(
            f"vLLM does not serve {title} drafts"
            + (
                f": {algorithms.get(c.algorithm).not_served}"
                if algorithms.get(c.algorithm).not_served
                else ""
            ),
            "evaluate it in PyTorch: --engine torch",
        )
    if cfg.engine == "vllm" and vllm_formats:
        from spec_cli.engine import vllm

        why = vllm.cannot_run(algorithms.get(c.algorithm).format(vllm_formats[0]))
        if why:
            raise ConfigError(
                f"spec eval cannot run {algorithms.get(c.algorithm).title} drafts in vLLM here: {why}",
                "evaluate it in PyTorch: --engine torch",
            )
    if cfg.engine == "vllm" and loaded.kind == "export" and loaded.format not in vllm_formats:
        raise ConfigError(
            f"vLLM does not read a {loaded.format} export ({loaded.path})",
            f"pass a {' or '.join(vllm_formats) or 'vLLM'} export, or the run / checkpoint (exported for vLLM "
            "on the fly)",
        )
    conversations = prompts.load_conversations(cfg.prompts, cfg.num_prompts)
    processor = None
    if any(conv.images for conv in conversations):  # image prompts: made by the target's processor
        if cfg.engine == "vllm":
            raise ConfigError(
                f"{sum(bool(conv.images) for conv in conversations)} prompts have images; spec eval "
                "runs image prompts in PyTorch only for now",
                "pass --engine torch",
            )
        processor = loading.load_processor(target_dir)
    output = Path(cfg.output) if cfg.output else default_output(loaded)
    if cfg.output is None:
        _check_output(cfg, output)

    device = loading.choose_device(cfg.device)
    dtype = loading.choose_dtype(cfg.dtype, device)
    info(
        f"loading {target_dir.name} ({str(dtype).replace('torch.', '')} on {device}) and the draft "
        f"{loaded.describe()}" + (" in vLLM" if cfg.engine == "vllm" else "")
    )
    nodes = tree_size(cfg.depth, cfg.topk, cfg.num_tokens) if cfg.topk > 1 else cfg.depth
    settings = Settings(
        depth=cfg.depth,
        topk=cfg.topk,
        num_tokens=nodes,
        temperature=cfg.temperature,
        draft_sampling=cfg.draft_sampling,
        max_new_tokens=cfg.max_new_tokens,
        adaptive=cfg.adaptive_verification,
        eos_ids=eos_ids(tokenizer, loading.generation_config(target_dir))
        | chat_templates.end_of_turn_ids(tokenizer, template),
    )
    info(work_text(cfg, conversations, nodes, compared))
    opener = _vllm_decoders if cfg.engine == "vllm" else _torch_decoders
    choice = threads.choose_for_run(cfg.threads)  # before the models load (vLLM then sets its own)
    with (
        threads.applied(choice.threads, restore=cfg.engine == "torch"),
        opener(cfg, loaded, target_dir, device, dtype, settings) as (
            spec,
            base,
            engine_info,
            probe,
            rule,
        ),
    ):
        used = torch.get_num_threads()
        reason = (
            choice.reason
            if used == choice.threads
            else f"set by {cfg.engine} (asked for {choice.threads}: {choice.reason})"
        )
        info(f"timing on {used} thread{'s' if used != 1 else ''}: {reason}")
        seeds = _Seeds(cfg.seed) if cfg.temperature > 0 else None
        warm = replace(settings, max_new_tokens=min(WARMUP_TOKENS, cfg.max_new_tokens))
        first = prompts.prompt_ids(tokenizer, conversations[0], 0, processor)
        costs = None
        if cfg.compare_depths == AUTO:
            costs = probe(first, list(range(1, cfg.depth + 2)))
            compared = cheaper_depths(costs, cfg.depth)
            info(cost_text(costs, cfg.depth, compared))
        others = {d: _at_depth(spec, replace(settings, depth=d, num_tokens=d)) for d in compared}
        try:
            spec(first, seeds and seeds(0, 0, 0), warm)
            base(first, seeds and seeds(0, 0, 1), warm)
            for d in compared:
                spec(first, seeds and seeds(0, 0, 0), replace(warm, depth=d, num_tokens=d))
        except Exception as exc:
            raise turn_failed(
                exc, f"the warm-up on prompt {conversations[0].id!r}, turn 1"
            ) from exc
        output.mkdir(parents=True, exist_ok=True)
        (
            output / outputs.EVAL_MARKER
        ).touch()  # a spec eval folder from here on: a rerun may replace it
        (output / "eval.json").unlink(missing_ok=True)  # never an old eval.json beside new outputs
        meter = threads.Meter()
        overall, categories, records = decode_all(
            spec,
            base,
            tokenizer,
            conversations,
            settings,
            seeds,
            cfg.timing_repeats,
            outputs=output / "outputs.jsonl",
            eps=torch.finfo(dtype).eps,
            processor=processor,
            others=others,
        )
        busy = meter.stop(used, threads.available_cores(), on_cpu=device.type == "cpu")

    settings_json = {
        "depth": cfg.depth,
        "topk": cfg.topk,
        "num_tokens": settings.num_tokens,
        "temperature": cfg.temperature,
        **rule,
        "max_new_tokens": cfg.max_new_tokens,
        "adaptive_verification": cfg.adaptive_verification,
        "prompts": cfg.prompts,
        "num_prompts": len(conversations),
        "turns": sum(len(conv.turns) for conv in conversations),
        "seed": cfg.seed,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "eos_ids": sorted(settings.eos_ids),
        "engine": cfg.engine,
        "threads": used,
        "threads_reason": reason,
        "timing_repeats": cfg.timing_repeats,
        "compare_depths": sorted(compared),
        **({"compare_depths_asked": AUTO} if cfg.compare_depths == AUTO else {}),
    }
    overall_m = overall.metrics()
    depths = None
    if compared:  # every chain decoded, the run's own depth among them, against the same baseline
        depths = dict(
            sorted(
                {
                    cfg.depth: overall_m,
                    **{d: t.metrics() for d, t in overall.by_depth.items()},
                }.items()
            )
        )
    category_m = {name: t.metrics() for name, t in categories.items()}
    json_path, outputs_path = (
        output / "eval.json",
        output / "outputs.jsonl",
    )  # outputs: by decode_all
    plot_path = output / "acceptance.png"
    write_json(
        json_path,
        {
            "kind": "eval",
            "schema_version": SCHEMA_VERSION,
            "version": __version__,
            "target": str(target_dir),
            "draft": {
                "path": str(loaded.path),
                "kind": loaded.kind,
                "format": loaded.format,
                "step": loaded.step,
                "aux_layer_outputs": list(c.aux_layer_ids),
            },
            "engine": engine_info,
            "settings": settings_json,
            "overall": overall_m,
            "categories": category_m,
            "busy": busy,
            **(
                {
                    "depths": {str(d): m for d, m in depths.items()},
                    "fastest_depth": fastest_depth(depths),
                }
                if depths
                else {}
            ),
            **(
                {"verify_seconds": {str(n): round(t, 6) for n, t in costs.items()}} if costs else {}
            ),
        },
    )
    shape = (
        f"chain {cfg.depth}"
        if cfg.topk == 1
        else f"tree {cfg.depth}x{cfg.topk}/{settings.num_tokens}"
    )
    where = " in vLLM" if cfg.engine == "vllm" else ""
    plot_acceptance(
        plot_path,
        overall_m,
        category_m,
        f"{loaded.path.name} on {target_dir.name}{where} ({shape}): acceptance length "
        f"{overall_m['acceptance_length']:.2f}, speed-up {overall_m['speedup']:.2f}x",
    )
    return EvalResult(
        output=output,
        json_path=json_path,
        plot_path=plot_path,
        outputs_path=outputs_path,
        draft=loaded.describe(),
        target_name=target_dir.name,
        settings=settings_json,
        overall=overall_m,
        categories=category_m,
        seconds=time.perf_counter() - start,
        engine=cfg.engine,
        busy=busy,
        depths=depths,
    )


AUTO = "auto"
CHEAPER = 0.9  # --compare-depths auto: a shorter chain is compared when its forward costs <= this x the longest's


def work_text(
    cfg: EvalConfig, conversations: list[prompts.Conversation], nodes: int, compared: list[int]
) -> str:
    """The decoding to come, said before the models load: its length depends on the machine, and
    the time left follows once turns finish (the progress bar, or its lines in a log)."""
    turns = sum(len(conv.turns) for conv in conversations)
    shape = f"chain {cfg.depth}" if cfg.topk == 1 else f"tree {cfg.depth}x{cfg.topk}/{nodes}"
    if cfg.compare_depths == AUTO:
        others = "; so do the shorter chains worth comparing (--compare-depths auto)"
    else:
        depths = ", ".join(map(str, sorted(compared)))
        others = f"; so do chains of depth {depths}" if compared else ""
    repeats = f", {cfg.timing_repeats} times" if cfg.timing_repeats > 1 else ""
    return (
        f"eval: {turns} turns of {len(conversations)} prompts, up to {cfg.max_new_tokens} new "
        f"tokens each; the draft ({shape}) and the target alone decode every turn"
        f"{repeats}{others}"
    )


def cheaper_depths(costs: dict[int, float], depth: int) -> list[int]:
    """The chain depths below `depth` whose verification forward (d + 1 tokens) is measurably cheaper
    than the chain's own (depth + 1): only those can be faster (the drafts they skip cost little)."""
    return [d for d in range(1, depth) if costs[d + 1] <= CHEAPER * costs[depth + 1]]


def cost_text(costs: dict[int, float], depth: int, compared: list[int]) -> str:
    """The measured verification cost curve and what it decided, in one line."""
    curve = ", ".join(f"{n} tokens {costs[n] / costs[1]:.2f}x" for n in sorted(costs) if n > 1)
    decided = (
        f"comparing chains of {', '.join(map(str, compared))} with {depth}"
        if compared
        else f"no shorter chain verifies measurably cheaper than {depth}: comparing none"
    )
    return (
        f"the target's forward on this machine, against one token ({1000 * costs[1]:.1f} ms): {curve}; "
        f"{decided}"
    )


def _at_depth(spec: Decoder, settings: Settings) -> Decoder:
    """The speculative decoder with a chain of settings.depth (its warm-up passes shorter settings)."""

    def decode(ids, seed, s=settings):
        return spec(ids, seed, s)

    return decode


@contextlib.contextmanager
def _torch_decoders(
    cfg: EvalConfig, loaded: drafts.LoadedDraft, target_dir: Path, device, dtype, settings: Settings
):
    """spec_cli's decoder and the target alone (plain decoding with its KV cache), both in PyTorch."""
    session = TorchSession(target_dir, device, dtype)
    try:
        spec, base = session.decoders(loaded, settings)
        if cfg.topk > 1 and session.target.attn_implementation not in TREE_ATTENTION:
            raise ConfigError(
                f"tree verification needs sdpa or eager attention; the target uses "
                f"{session.target.attn_implementation}",
                "use a chain (--topk 1)",
            )
        yield spec, base, session.info, session.verify_costs, decoding_rule(settings)
    finally:
        session.close()


@contextlib.contextmanager
def _vllm_decoders(
    cfg: EvalConfig, loaded: drafts.LoadedDraft, target_dir: Path, device, dtype, settings: Settings
):
    """Two vLLM engines in this process: the target with the draft (a chain of --depth) and the
    target alone. A run or checkpoint is exported for vLLM into a temporary folder first."""
    from spec_cli.engine import vllm

    vllm.require("spec eval --engine vllm")
    with contextlib.ExitStack() as stack:
        folder = loaded.path
        if loaded.kind != "export":
            from spec_cli.stages import export

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spec-eval-vllm-")))
            info(f"exporting {loaded.path} for vLLM (fp32) into a temporary folder")
            folder = export.run(
                export.ExportConfig(
                    source=loaded.path,
                    format="vllm",
                    output=tmp / "draft",
                    dtype="fp32",
                    engine_check="none",
                    target=str(target_dir),
                )
            ).output
        session = VllmSession(target_dir, dtype, cfg.depth, loaded.model.config.algorithm, cfg.seed)
        stack.callback(session.close)
        spec, base = session.decoders(folder, settings)
        if session.load_problems:
            info("warning: " + "; ".join(session.load_problems))
        yield spec, base, session.info, None, session.decoding_rule(settings)


def decode_all(
    spec: Decoder,
    base: Decoder,
    tokenizer,
    conversations: list[prompts.Conversation],
    settings: Settings,
    seeds: _Seeds | None,
    repeats: int = 1,
    outputs: Path | None = None,
    eps: float = torch.finfo(torch.float32).eps,
    processor=None,
    others: dict[int, Decoder] | None = None,
):
    """Every turn of every conversation, speculative then target alone on the same prompt (`repeats`
    times, alternating); turn j is asked after the speculative decoder's answer to turn j-1.
    `others`: chains of other depths, each decoding every turn after those two (the same baseline),
    tallied in overall.by_depth. `outputs` (outputs.jsonl) is rewritten after every turn; a turn that
    fails raises an error naming its prompt and turn, the turns before it kept there.
    -> (overall, per-category Tally, records)."""
    overall, categories, records = Tally(settings.depth), {}, []
    others = others or {}
    overall.by_depth = {d: Tally(d) for d in others}
    if outputs is not None:
        write_records(outputs, records)
    with progress("eval", sum(len(conv.turns) for conv in conversations), unit="turns") as bar:
        for i, conv in enumerate(conversations):
            for turn in range(len(conv.turns)):
                try:
                    ids = prompts.prompt_ids(tokenizer, conv, turn, processor)
                    s, b, record = timed_turn(
                        spec,
                        base,
                        ids,
                        seeds and seeds(i, turn, 0),
                        seeds and seeds(i, turn, 1),
                        repeats,
                        others,
                    )
                except Exception as exc:
                    kept = outputs and f"the turns before it ({len(records)}) are in {outputs}"
                    raise turn_failed(
                        exc,
                        f"prompt {conv.id!r} ({i + 1} of {len(conversations)}), turn {turn + 1}",
                        kept,
                    ) from exc
                parted = parting(s, b, eps) if settings.temperature == 0 else None
                overall.add(s, b, parted)
                for d, g in record.pop("by_depth", {}).items():
                    overall.by_depth[d].add(
                        g, b, parting(g, b, eps) if settings.temperature == 0 else None
                    )
                    record.setdefault("depths", {})[str(d)] = {
                        "acceptance_length": round(g.acceptance_length, 4),
                        "spec_seconds": round(g.seconds, 4),
                        "speedup": None
                        if turn_speedup(g, b) is None
                        else round(turn_speedup(g, b), 4),
                        "same_as_target": g.tokens == b.tokens,
                    }
                if conv.category:
                    categories.setdefault(conv.category, Tally(settings.depth)).add(s, b, parted)
                answer = tokenizer.decode(s.tokens, skip_special_tokens=True).strip()
                conv.answers.append(answer)
                records.append(
                    {
                        "id": conv.id,
                        "category": conv.category,
                        "turn": turn,
                        "prompt_tokens": len(ids),
                        "tokens": len(s.tokens),
                        "acceptance_length": round(s.acceptance_length, 4),
                        "accepted_per_step": [m for m, _ in s.steps],
                        "same_as_target": s.tokens == b.tokens,
                        **({"parted_at": parted} if parted else {}),
                        **record,
                        "answer": answer,
                    }
                )
                if outputs is not None:
                    write_records(outputs, records)
                bar.advance()
    return overall, categories, records


def write_records(path: Path, records: list[dict]) -> None:
    """outputs.jsonl, one JSON object a line, written atomically (a reader sees it whole)."""
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


class TurnError(SpecError):
    """A turn that failed on an error the user can fix (its cause's message and hint, and where)."""


def turn_failed(exc: Exception, where: str, kept: str | None = None) -> Exception:
    """`exc` raised while decoding `where`, said with where and what was kept: a TurnError for a user
    error, a RuntimeError (a bug: the CLI says so) for anything else."""
    if isinstance(exc, SpecError):
        hint = "; ".join(h for h in (exc.hint, kept) if h) or None
        return TurnError(f"{where}: {exc.message}", hint)
    return RuntimeError(
        f"{where} failed: {type(exc).__name__}: {exc}" + (f" ({kept})" if kept else "")
    )


def timed_turn(
    spec: Decoder,
    base: Decoder,
    ids: list[int],
    spec_seed: int | None,
    base_seed: int | None,
    repeats: int,
    others: dict[int, Decoder] | None = None,
) -> tuple[Generation, Generation, dict]:
    """One turn decoded `repeats` times by each decoder, alternating (spec, base, [the other depths,]
    spec, base, ...) so that a change in the machine's load hits all; the same seeds each time, so the
    same output. -> (spec, base) with their median seconds, and the turn's timing fields for
    outputs.jsonl (with `others`, "by_depth": {depth: its Generation, median seconds}, for the caller)."""
    spec_runs, base_runs, other_runs = [], [], {d: [] for d in others or {}}
    for _ in range(repeats):
        spec_runs.append(spec(ids, spec_seed))
        base_runs.append(base(ids, base_seed))
        for d, decode in (others or {}).items():
            other_runs[d].append(decode(ids, spec_seed))
    s, b = _median(spec_runs), _median(base_runs)
    ratio = turn_speedup(s, b)
    record = {
        "spec_seconds": round(s.seconds, 4),
        "target_seconds": round(b.seconds, 4),
        "speedup": None if ratio is None else round(ratio, 4),
    }
    if s.draft_seconds:  # the PyTorch loop times its draft (vLLM does not say)
        record["draft_seconds"] = round(s.draft_seconds, 4)
    if repeats > 1:
        record["spec_seconds_runs"] = [round(g.seconds, 4) for g in spec_runs]
        record["target_seconds_runs"] = [round(g.seconds, 4) for g in base_runs]
        # the median is of the same work only if every run gave the same tokens
        record["repeats_same_output"] = all(g.tokens == s.tokens for g in spec_runs) and all(
            g.tokens == b.tokens for g in base_runs
        )
    if others:
        record["by_depth"] = {d: _median(runs) for d, runs in other_runs.items()}
    return s, b, record


def _median(runs: list[Generation]) -> Generation:
    """The first run with the median seconds (and draft seconds) of all (the same seeds: the same tokens)."""
    return replace(
        runs[0],
        seconds=statistics.median(g.seconds for g in runs),
        draft_seconds=statistics.median(g.draft_seconds for g in runs),
    )


class _Seeds:
    """A seed per (conversation, turn, decoder): sampling runs are reproducible."""

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self, *key: int) -> int:
        seed = self.seed
        for k in key:
            seed = (seed * 1_000_003 + k) % (2**63)
        return seed
