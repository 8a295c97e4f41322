"""What moves acceptance at a fixed budget: the recipe levers, each alone and combined, on the demo's
own data, each draft measured the way `spec eval` measures it (real speculative decoding with the
SmolLM2 target, greedy, a chain of --depth, both turns) on MT-bench and on held-out ShareGPT chats.

    spec demo --quick                 # (or the default demo) makes the data, vocab map and cache
    python bench/recipe.py --demo ~/.cache/spec_cli/demo/quick --out /tmp/recipe \
        --variants base,muon,noise,wsd,init,layers2,vd2048,lr3e-3
    python bench/recipe.py ... --variants base,wsd --seeds 0,1           # noise between seeds
    python bench/recipe.py ... --variants wsd+orig300 --scales 0.5,1,2,4  # AL against training compute
    python bench/recipe.py ... --variants wsd+regen2560,wsd+written2560 --scales 1,2
                                          # the target's own answers against the same prompts as written
    python bench/recipe.py ... --variants wsd,wsd+peagle,wsd+dflash4,wsd+dflash8,wsd+dflash16 --timed
                                                                         # the algorithms, with speed-ups

Every variant trains on the demo's training data (its regenerated and original conversations, packed)
for the demo profile's steps x --scale of its batch_tokens, with the profile's settings unless the
variant changes one: equal budgets, one lever at a time ("base" is AdamW with a cosine schedule,
whatever the demo's profile now uses; "orig300" adds 300 ShareGPT conversations as written, "regen2560"
2,560 more ShareGPT prompts answered by the target, "written2560" the same conversations as written,
"sampledN" N more answers to the demo's own prompts, sampled at temperature 0.8 with seeds 1..N).
"a+b" combines variants. The vocab map and cache for Vd 4096 are the demo's; other sizes and data are
built once into OUT. Finished runs are reused (rerun
with more variants to add rows). The table is printed as markdown and kept in OUT/recipe.json.
Algorithms are levers too: `peagle` (K = --depth mask slots, the EAGLE-3 cache), `dflashN` (blocks of
N, one layer like the EAGLE-3 draft, its own five-layer cache built once into OUT, decoded with a chain
of N - 1: one draft forward per cycle) and `dsparkN` (blocks of N queries proposing N, the same cache;
`anchors512` adds --max-anchors 512 to either). --timed also decodes every prompt with the target alone (once
per run of this script, same process) and reports each draft's speed-up over it, as `spec eval` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spec_cli import assets  # noqa: E402
from spec_cli.artifacts import checkpoint as ckpt  # noqa: E402
from spec_cli.console import set_quiet  # noqa: E402
from spec_cli.data import records  # noqa: E402
from spec_cli.eval import drafts, prompts  # noqa: E402
from spec_cli.eval.report import Tally  # noqa: E402
from spec_cli.eval.speculative import Settings, eos_ids, generate, generate_target  # noqa: E402
from spec_cli.eval.target import Target  # noqa: E402
from spec_cli.stages import build_vocab_map, demo, precompute, train  # noqa: E402
from spec_cli.targets import loading  # noqa: E402

# name -> TrainConfig overrides ("vocab": the draft vocabulary size; everything else a `spec train` option)
LEVERS = {
    "base": {},
    "muon": dict(optimizer="muon"),
    "muon-lr3e-3": dict(optimizer="muon", lr=3e-3),
    "noise": dict(hidden_noise=0.05),
    "noise0.1": dict(hidden_noise=0.1),
    "wsd": dict(schedule="wsd", decay_ratio=0.2),
    "init": dict(init_from_target=True),
    "initlayer": dict(
        init_layer_from_target=True
    ),  # the draft layer from the target layer after the last aux
    # the draft's attention over the last N positions only (speculators trains 2048; the demo's rows are <= 256)
    "window32": dict(draft_window=32),
    "window64": dict(draft_window=64),
    "window128": dict(draft_window=128),
    "layers2": dict(draft_layers=2),
    "layers5": dict(draft_layers=5),  # the peers' published DFlash drafts' depth
    "vd2048": dict(vocab=2048),
    "vd8192": dict(vocab=8192),
    "lr3e-3": dict(lr=3e-3),
    "lr5e-4": dict(lr=5e-4),
    "ttt5": dict(ttt_steps=5),
    "stepw1": dict(step_weight=1.0),
    "wd0.01": dict(weight_decay=0.01),
    # more ShareGPT conversations with their original answers after the demo's (prefill only, no generation)
    "orig300": dict(extra=300),
    "orig900": dict(extra=900),
    # more conversations answered by the target itself (regenerated, in vLLM when installed: generation,
    # not only a prefill), ShareGPT prompts from REGEN_FROM on, appended to the demo's data
    "regen640": dict(regen=640),
    "regen2560": dict(regen=2560),
    # the control: the conversations regen2560 answered, with their answers as ShareGPT wrote them
    "written2560": dict(written=2560),
    # fresh answers to the same prompts (lever 2): the demo's regenerated prompts answered again by the
    # target, sampled (SAMPLED_TEMPERATURE, seed 1, 2, ...), appended to the demo's data
    "sampled1": dict(sampled=1),
    "sampled2": dict(sampled=2),
    # other draft algorithms at the same budget ("depth": the chain each proposes per cycle)
    "peagle": dict(algorithm="peagle"),
    "dflash4": dict(algorithm="dflash", block_size=4, depth=3, fc_norm=False),
    "dflash8": dict(algorithm="dflash", block_size=8, depth=7, fc_norm=False),
    "dflash16": dict(algorithm="dflash", block_size=16, depth=15, fc_norm=False),
    # DSpark: N queries propose N tokens (its anchor proposes too), the Markov head's default rank
    "dspark3": dict(algorithm="dspark", block_size=3, depth=3, fc_norm=False),
    "dspark7": dict(algorithm="dspark", block_size=7, depth=7, fc_norm=False),
    "dspark15": dict(algorithm="dspark", block_size=15, depth=15, fc_norm=False),
    # --max-anchors for the block drafters: blocks at 512 random slots a row and step, not every slot
    "anchors512": dict(max_anchors=512),
}
NOT_TRAIN_OPTIONS = ("vocab", "extra", "regen", "written", "sampled", "depth")
SAMPLED_TEMPERATURE = 0.8
HELDOUT_FROM = 3000  # ShareGPT conversations from here on: after anything a demo profile trains on
REGEN_FROM = 4000  # the prompts a regenN lever has the target answer: after the held-out chats


def settings_of(name: str, profile: demo.Profile) -> dict:
    """A variant's options: the demo profile's, then each "+"-joined lever's."""
    options = dict(
        vocab=profile.draft_vocab_size,
        extra=0,
        regen=0,
        written=0,
        sampled=0,
        lr=profile.lr,
        ttt_steps=profile.ttt_steps,
    )
    for part in name.split("+"):
        if part not in LEVERS:
            raise SystemExit(f"unknown variant {part!r}: use {', '.join(LEVERS)} (joined with +)")
        options.update(LEVERS[part])
    return options


def regenerated_more(out: Path, profile: demo.Profile, target: str, count: int) -> Path:
    """`count` ShareGPT prompts from REGEN_FROM on, answered by the target as the demo's regenerate stage
    answers its own (greedy, the profile's lengths; vLLM when installed). Resumes like `spec regenerate`."""
    from spec_cli.stages import regenerate

    path = out / f"regen-{count}.jsonl"
    prompts_path = out / f"regen-{count}-prompts.jsonl"
    if not prompts_path.is_file():
        found = {"sharegpt": assets.resolve_data_arg("sharegpt")}
        chosen = list(demo._sharegpt_after(found, REGEN_FROM - 1, count))
        prompts_path.write_text(
            "".join(json.dumps({"messages": r["messages"]}) + "\n" for r in chosen)
        )
    engine = demo.regen_engine(demo.DemoConfig())
    t0 = time.perf_counter()
    outcome = regenerate.run(
        regenerate.RegenerateConfig(
            target=target,
            data=str(prompts_path),
            output=path,
            temperature=0.0,
            max_new_tokens=profile.regen_max_new_tokens,
            max_length=profile.max_length,
            max_samples=count,
            engine=engine,
            dtype=demo.data_dtype(demo.DemoConfig()),
        )
    )
    if not outcome.already_complete:
        print(
            f"regenerated {count} answers in {engine}: {time.perf_counter() - t0:.0f} s", flush=True
        )
    return path


def data_key(extra: int, regen: int = 0, written: int = 0, sampled: int = 0) -> str:
    return (
        f"{extra}"
        + (f"+r{regen}" if regen else "")
        + (f"+w{written}" if written else "")
        + (f"+s{sampled}" if sampled else "")
    )


def sampled_again(out: Path, folder: Path, profile: demo.Profile, target: str, seed: int) -> Path:
    """The demo's regenerated conversations answered again by the target, sampled at SAMPLED_TEMPERATURE
    with this seed (regenerate answers every user turn afresh; resumable like `spec regenerate`)."""
    from spec_cli.stages import regenerate

    path = out / f"sampled-{seed}.jsonl"
    engine = demo.regen_engine(demo.DemoConfig())
    t0 = time.perf_counter()
    outcome = regenerate.run(
        regenerate.RegenerateConfig(
            target=target,
            data=str(folder / "regenerated.jsonl"),
            output=path,
            temperature=SAMPLED_TEMPERATURE,
            seed=seed,
            max_new_tokens=profile.regen_max_new_tokens,
            max_length=profile.max_length,
            engine=engine,
            dtype=demo.data_dtype(demo.DemoConfig()),
        )
    )
    if not outcome.already_complete:
        print(
            f"sampled answers (seed {seed}) in {engine}: {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    return path


def training_data(
    out: Path,
    folder: Path,
    extra: int,
    regen: int = 0,
    profile: demo.Profile | None = None,
    target: str | None = None,
    written: int = 0,
    sampled: int = 0,
) -> Path:
    """The demo's training data, plus `extra` further ShareGPT conversations as written (after the last
    one the demo used; the held-out prompts come later still), `regen` further ones answered by the
    target (from REGEN_FROM on) and `written` ones from REGEN_FROM on as written (the same prompts)."""
    if not extra and not regen and not written and not sampled:
        return folder / "train.jsonl"
    path = out / f"train+{data_key(extra, regen, written, sampled)}.jsonl"
    if not path.is_file():
        text = (folder / "train.jsonl").read_text()
        if extra:
            found = {"sharegpt": assets.resolve_data_arg("sharegpt")}
            more = demo._sharegpt_after(
                found, demo._last_source_index(folder / "train.jsonl"), extra
            )
            text += "".join(json.dumps({**r, "source": "sharegpt"}) + "\n" for r in more)
        if regen:
            text += regenerated_more(out, profile, target, regen).read_text()
        if (
            written
        ):  # the prompts regen{written} answered (regenerate skips a prompt over --max-length)
            found = {"sharegpt": assets.resolve_data_arg("sharegpt")}
            chosen = list(demo._sharegpt_after(found, REGEN_FROM - 1, written))
            answered = [
                json.loads(line)["source_index"]
                for line in regenerated_more(out, profile, target, written).read_text().splitlines()
            ]
            text += "".join(
                json.dumps({**chosen[i], "source": "sharegpt"}) + "\n" for i in answered
            )
        for seed in range(1, sampled + 1):
            text += sampled_again(out, folder, profile, target, seed).read_text()
        path.write_text(text)
    return path


def prepare(
    out: Path,
    folder: Path,
    profile: demo.Profile,
    vocab: int,
    extra: int,
    target: str,
    algorithm: str = "eagle3",
    regen: int = 0,
    written: int = 0,
    sampled: int = 0,
) -> tuple[Path, Path]:
    """The vocab map (the demo's data: what the target writes) and feature cache of the training data at
    this vocabulary size, for the algorithm's aux layers (EAGLE-3 and P-EAGLE read the same three)."""
    own = folder / f"vocab-{vocab}.safetensors"
    kind = (
        "dflash" if algorithm in ("dflash", "dspark") else "eagle3"
    )  # (DSpark reads DFlash's five layers)
    if (
        own.is_file()
        and (folder / "cache").is_dir()
        and not extra
        and not regen
        and not written
        and not sampled
        and kind == "eagle3"
    ):
        return own, folder / "cache"
    vmap = own if own.is_file() else out / "maps" / f"vocab-{vocab}.safetensors"
    cache = (
        out
        / "caches"
        / (
            f"vocab-{vocab}+{data_key(extra, regen, written, sampled)}"
            + ("-dflash" if kind == "dflash" else "")
        )
    )
    data = str(training_data(out, folder, extra, regen, profile, target, written, sampled))
    if not vmap.is_file():
        build_vocab_map.run(
            build_vocab_map.BuildVocabMapConfig(
                target=target,
                data=str(folder / "regenerated.jsonl"),
                output=vmap,
                draft_vocab_size=vocab,
                max_length=profile.max_length,
                num_proc=2,
            )
        )
    precompute.run(
        precompute.PrecomputeConfig(
            target=target,
            data=data,
            vocab_map=vmap,
            output=cache,
            max_length=profile.max_length,
            batch_tokens=8192,
            num_proc=2,
            resume=True,
            algorithm=kind,
            dtype=demo.data_dtype(demo.DemoConfig()),
        )
    )  # as the demo's precompute: bf16 where it is native
    return vmap, cache


def train_variant(
    out: Path,
    run_name: str,
    options: dict,
    vmap: Path,
    cache: Path,
    profile: demo.Profile,
    steps: int,
    seed: int,
) -> tuple[Path, dict, float]:
    """(checkpoint, last held-out eval record, training seconds) of one run, reused when finished."""
    run_dir = out / "runs" / run_name
    latest = ckpt.latest_checkpoint(run_dir)
    t0 = time.perf_counter()
    if latest is None or json.loads((latest / "trainer_state.json").read_text())["step"] < steps:
        options = {
            "fc_norm": True,
            **{k: v for k, v in options.items() if k not in NOT_TRAIN_OPTIONS},
        }
        outcome = train.run(
            train.TrainConfig.from_options(
                vocab_map=vmap,
                output=run_dir,
                cache=cache,
                pack=True,
                batch_tokens=profile.batch_tokens,
                max_steps=steps,
                eval_fraction=0.03,
                log_every=10,
                eval_every=10**9,
                save_every=10**9,
                seed=seed,
                resume=latest is not None,
                **options,
            )
        )
        latest = outcome.checkpoint
    seconds = time.perf_counter() - t0
    last_eval = {}
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "eval":
            last_eval = record
    return latest, last_eval, seconds


def acceptance(
    target: Target, target_dir: Path, checkpoint: Path, tokenizer, conversations, settings
) -> dict:
    """Acceptance length over every turn's cycles, as `spec eval` counts it (1 + accepted per cycle)."""
    loaded = drafts.load_draft(checkpoint, loading.load_config(target_dir))
    draft = loaded.model
    if loaded.needs_embeddings:
        draft.copy_embeddings(target.model.get_input_embeddings().weight.float().cpu())
    draft.eval()
    accepted = cycles = first = 0
    seconds = draft_seconds = 0.0
    outputs = []
    tally = Tally(positions=settings.depth)
    for conv in conversations:
        conv.answers.clear()
        for turn in range(len(conv.turns)):
            g = generate(target, draft, prompts.prompt_ids(tokenizer, conv, turn), settings, None)
            tally.add(g, None)
            accepted += sum(m for m, _ in g.steps)
            cycles += len(g.steps)
            first += sum(1 for m, _ in g.steps if m >= 1)
            seconds += g.seconds
            draft_seconds += g.draft_seconds
            outputs.append(g.tokens)
            conv.answers.append(tokenizer.decode(g.tokens, skip_special_tokens=True).strip())
    m = tally.metrics()  # (the confidence head's calibration, for a draft that has one: DSpark)
    return {
        "acceptance_length": 1 + accepted / max(1, cycles),
        "first_position": first / max(1, cycles),
        "cycles": cycles,
        "seconds": round(seconds, 2),
        "draft_seconds": round(draft_seconds, 2),
        "outputs": outputs,
        "acceptance_rate": m["acceptance_rate"],
        "predicted_acceptance": m["predicted_acceptance"],
    }


def target_alone(target: Target, tokenizer, conversations, settings) -> dict:
    """The baseline: every turn decoded by the target alone (greedy: the same text as speculative decoding)."""
    seconds, outputs = 0.0, []
    for conv in conversations:
        conv.answers.clear()
        for turn in range(len(conv.turns)):
            g = generate_target(target, prompts.prompt_ids(tokenizer, conv, turn), settings, None)
            seconds += g.seconds
            outputs.append(g.tokens)
            conv.answers.append(tokenizer.decode(g.tokens, skip_special_tokens=True).strip())
    return {"seconds": round(seconds, 2), "outputs": outputs}


def heldout_file(out: Path, n: int) -> Path:
    """n ShareGPT conversations from HELDOUT_FROM on (no demo profile trains on them), as a chat file."""
    path = out / f"heldout-{n}.jsonl"
    if not path.is_file():
        chosen = []
        for i, record in enumerate(records.load_records(assets.resolve_data_arg("sharegpt"))):
            if i >= HELDOUT_FROM and (record.get("conversations") or record.get("messages")):
                chosen.append(record)
            if len(chosen) == n:
                break
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return path


def table(results: dict) -> str:
    """Markdown: one row per variant (mean and spread over its seeds), then the runs themselves."""
    by_variant: dict[str, list[dict]] = {}
    for row in results.values():
        by_variant.setdefault((row["variant"], row["scale"]), []).append(row)
    lines = [
        "| variant | scale | steps | seeds | depth | held-out top-1 | MT-bench AL | held-out AL | speed-up MT-bench | "
        "speed-up held-out | draft ms/cycle | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(values, digits=3):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.{digits}f}"
        return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    def ms_per_cycle(r):
        cycles = r["mt_bench"]["cycles"] + r["heldout"]["cycles"]
        seconds = r["mt_bench"].get("draft_seconds", 0) + r["heldout"].get("draft_seconds", 0)
        return 1000 * seconds / cycles if cycles and seconds else None

    for (variant, scale), rows in sorted(by_variant.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(
            f"| {variant} | {scale:g} | {rows[0]['steps']} | {len(rows)} | {rows[0].get('depth', '-')} | "
            f"{spread([r['heldout_top1'] for r in rows])} | "
            f"{spread([r['mt_bench']['acceptance_length'] for r in rows])} | "
            f"{spread([r['heldout']['acceptance_length'] for r in rows])} | "
            f"{spread([r['mt_bench'].get('speedup') for r in rows], 2)} | "
            f"{spread([r['heldout'].get('speedup') for r in rows], 2)} | "
            f"{spread([ms_per_cycle(r) for r in rows], 1)} | "
            f"{statistics.mean(r['train_seconds'] for r in rows):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--demo", type=Path, required=True, help="a `spec demo` folder (quick or full)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--variants",
        default="base",
        help=f"comma-separated; levers: {', '.join(LEVERS)}; a+b combines",
    )
    parser.add_argument(
        "--seeds", default="0", help="comma-separated training seeds, for every variant"
    )
    parser.add_argument(
        "--scales", default="1", help="training compute as multiples of the profile's steps"
    )
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench questions (both turns)")
    parser.add_argument(
        "--heldout-prompts", type=int, default=8, help="held-out ShareGPT chats (first two turns)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--depth", type=int, default=3, help="the chain per cycle (a dflashN lever: N - 1)"
    )
    parser.add_argument(
        "--timed",
        action="store_true",
        help="also time the target alone on the same prompts and report speed-ups",
    )
    args = parser.parse_args()
    set_quiet(True)
    meta = json.loads((args.demo / demo.DEMO_JSON).read_text())
    profile = demo.PROFILES[meta["profile"]["name"]]
    target = str(assets.ensure_all(install=False)["smollm2"])
    target_dir = loading.resolve_target(target)
    tokenizer = loading.load_tokenizer(target_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "recipe.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}

    runs = [
        (v.strip(), float(scale), int(seed))
        for v in args.variants.split(",")
        if v.strip()
        for scale in args.scales.split(",")
        for seed in args.seeds.split(",")
    ]
    model = loading.load_model(target_dir, torch.device("cpu"), torch.float32)
    mt = prompts.load_conversations("mt-bench", args.prompts)
    held = prompts.load_conversations(str(heldout_file(args.out, args.heldout_prompts)))
    for conv in held:
        del conv.turns[2:]  # the first two user turns, as MT-bench has
    eos = eos_ids(tokenizer, loading.generation_config(target_dir))
    baseline = {}
    if args.timed:  # the target alone, measured in this process (the speed-ups below divide by it)
        plain = Settings(max_new_tokens=args.max_new_tokens, eos_ids=eos)
        alone = Target(model, [])
        baseline = {
            "mt_bench": target_alone(alone, tokenizer, mt, plain),
            "heldout": target_alone(alone, tokenizer, held, plain),
        }
        alone.close()
        print("target alone:", {k: v["seconds"] for k, v in baseline.items()}, "s", flush=True)
    for variant, scale, seed in runs:
        run_name = f"{variant}-x{scale:g}-s{seed}"
        options = settings_of(variant, profile)
        depth = options.get("depth", args.depth)
        steps = max(1, round(profile.steps * scale))
        vmap, cache = prepare(
            args.out,
            args.demo,
            profile,
            options["vocab"],
            options.get("extra", 0),
            target,
            options.get("algorithm", "eagle3"),
            options.get("regen", 0),
            options.get("written", 0),
            options.get("sampled", 0),
        )
        checkpoint, last_eval, seconds = train_variant(
            args.out, run_name, options, vmap, cache, profile, steps, seed
        )
        if (
            run_name in results
            and results[run_name]["steps"] == steps
            and (not args.timed or results[run_name]["mt_bench"].get("speedup"))
        ):
            continue
        settings = Settings(
            depth=depth,
            topk=1,
            num_tokens=depth,
            temperature=0.0,
            max_new_tokens=args.max_new_tokens,
            eos_ids=eos,
        )
        target_m = Target(
            model,
            drafts.load_draft(
                checkpoint, loading.load_config(target_dir)
            ).model.config.aux_layer_ids,
        )
        t0 = time.perf_counter()
        row = {
            "variant": variant,
            "scale": scale,
            "seed": seed,
            "steps": steps,
            "depth": depth,
            "options": options,
            "train_seconds": round(seconds, 1),
            "heldout_top1": (last_eval.get("acc") or [None])[0],
            "mt_bench": acceptance(target_m, target_dir, checkpoint, tokenizer, mt, settings),
            "heldout": acceptance(target_m, target_dir, checkpoint, tokenizer, held, settings),
        }
        row["eval_seconds"] = round(time.perf_counter() - t0, 1)
        target_m.close()
        for part in ("mt_bench", "heldout"):
            outputs = row[part].pop("outputs")
            if baseline:
                if outputs != baseline[part]["outputs"]:
                    raise SystemExit(
                        f"{run_name}: speculative decoding did not give the target's greedy text on {part}"
                    )
                row[part]["speedup"] = round(baseline[part]["seconds"] / row[part]["seconds"], 3)
        results[run_name] = row
        results_path.write_text(json.dumps(results, indent=2))
        print(
            run_name,
            json.dumps({k: row[k] for k in ("steps", "train_seconds", "heldout_top1")}),
            f"MT-bench AL {row['mt_bench']['acceptance_length']:.3f}, held-out AL "
            f"{row['heldout']['acceptance_length']:.3f}"
            + (
                f", speed-up {row['mt_bench']['speedup']:.2f}x / {row['heldout']['speedup']:.2f}x"
                if baseline
                else ""
            ),
            flush=True,
        )
    print(
        f"\n{profile.name} demo data, {profile.batch_tokens}-token packed steps, chain of {args.depth} (dflashN: N - 1), greedy, "
        f"{args.prompts} MT-bench questions and {args.heldout_prompts} held-out ShareGPT chats (both turns)\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
