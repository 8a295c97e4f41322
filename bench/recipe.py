"""What moves acceptance: train variants of the SmolLM2 draft at one budget and measure each the way
`spec eval` does (real speculative decoding, greedy, chain of --depth) on MT-bench and on held-out
chat prompts.

    python bench/recipe.py --data sharegpt=ORIG.jsonl --data regen=REGEN.jsonl --out /tmp/recipe \
        --steps 120 --variants base,regen,regen-init

Every variant trains for exactly --steps optimizer steps of --batch-tokens packed tokens, so the
comparison is at equal training budgets. Vocab maps and feature caches are built once per (data,
vocab size) and reused; finished runs are reused (rerun with another --variants to add some). The
table is printed as markdown and written to OUT/recipe.json. The target alone is not timed here
(acceptance only); `spec eval` gives the speed-up of the draft you choose.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spec_cli import assets  # noqa: E402
from spec_cli.artifacts import checkpoint as ckpt  # noqa: E402
from spec_cli.console import set_quiet  # noqa: E402
from spec_cli.draft.eagle3 import ttt  # noqa: E402
from spec_cli.eval import drafts, prompts  # noqa: E402
from spec_cli.eval.speculative import Settings, eos_ids, generate  # noqa: E402
from spec_cli.eval.target import Target  # noqa: E402
from spec_cli.stages import build_vocab_map, precompute, train  # noqa: E402
from spec_cli.target import loading  # noqa: E402

# name -> (data key, vocab size, TrainConfig overrides, eval temperature)
BASE = dict(ttt_steps=3, lr=1e-3, fc_norm=True)
VARIANTS = {
    "base": ("sharegpt", 8192, {}, 0.0),
    "regen": ("regen", 8192, {}, 0.0),
    "regen-oldpos": ("regen", 8192, dict(_old_positions=True), 0.0),  # TTT at step-0 positions (<= 0.x)
    "regen-init": ("regen", 8192, dict(init_from_target=True), 0.0),
    "regen-lr3e-3": ("regen", 8192, dict(lr=3e-3), 0.0),
    "regen-init-lr3e-3": ("regen", 8192, dict(init_from_target=True, lr=3e-3), 0.0),
    "regen-init-lr1e-2": ("regen", 8192, dict(init_from_target=True, lr=1e-2), 0.0),
    "regen-lr3e-4": ("regen", 8192, dict(lr=3e-4), 0.0),
    "regen-minlr": ("regen", 8192, dict(min_lr_ratio=0.1, warmup_ratio=0.1), 0.0),
    "regen-ttt5": ("regen", 8192, dict(ttt_steps=5), 0.0),
    "regen-ttt7": ("regen", 8192, dict(ttt_steps=7), 0.0),
    "regen-lk": ("regen", 8192, dict(loss="lk-lambda"), 0.0),
    "regen-nofcnorm": ("regen", 8192, dict(fc_norm=False), 0.0),
    "regen-normout": ("regen", 8192, dict(norm_output=True), 0.0),
    "regen-vd4096": ("regen", 4096, {}, 0.0),
    "regen-vd16384": ("regen", 16384, {}, 0.0),
    "regen-2x": ("regen", 8192, {}, 0.0),  # --steps x 2 (see below)
    "regen-t0.7": ("regen", 8192, {}, 0.7),
    "demo": ("demo", 8192, {}, 0.0),  # --data demo=DEMO/regenerated.jsonl (link the demo's cache and run)
    "demo-lr3e-3": ("demo", 8192, dict(lr=3e-3), 0.0),  # the greedy-data draft, served sampled
    "sampled-t0.7": ("sampled", 8192, {}, 0.7),  # sampled (0.7) data, served sampled
}


def prepare(out: Path, data: str, path: str, vocab: int, target: str, max_length: int) -> tuple[Path, Path]:
    vmap = out / "maps" / f"{data}-{vocab}.safetensors"
    if not vmap.is_file():
        build_vocab_map.run(build_vocab_map.BuildVocabMapConfig(
            target=target, data=path, output=vmap, draft_vocab_size=vocab, max_length=max_length, num_proc=2))
    cache = out / "caches" / f"{data}-{vocab}"
    precompute.run(precompute.PrecomputeConfig(
        target=target, data=path, vocab_map=vmap, output=cache, max_length=max_length,
        batch_tokens=8192, num_proc=2, resume=True))
    return vmap, cache


def step_zero_positions():
    """The TTT unroll as it was before positions advanced with the step (for the A/B row only)."""
    import inspect

    from spec_cli.draft import unroll

    source = inspect.getsource(unroll.unroll)
    assert "draft.rope(position_ids + k)" in source
    namespace = dict(vars(unroll))
    exec(source.replace("draft.rope(position_ids + k)", "draft.rope(position_ids)"), namespace)
    return namespace["unroll"]


def train_variant(out: Path, name: str, vmap: Path, cache: Path, steps: int, batch_tokens: int,
                  overrides: dict) -> tuple[Path, dict]:
    run_dir = out / "runs" / name
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None or json.loads((latest / "trainer_state.json").read_text())["step"] < steps:
        settings = {**BASE, **overrides}
        current = ttt.unroll  # what EAGLE-3's objective unrolls with
        if settings.pop("_old_positions", False):
            ttt.unroll = step_zero_positions()
        try:
            outcome = train.run(train.TrainConfig.from_options(
                vocab_map=vmap, output=run_dir, cache=cache, pack=True, batch_tokens=batch_tokens,
                max_steps=steps, eval_fraction=0.03, log_every=10, eval_every=10 ** 9, save_every=10 ** 9,
                resume=latest is not None, **settings))
        finally:
            ttt.unroll = current
        latest = outcome.checkpoint
    last_eval = {}
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "eval":
            last_eval = record
    return latest, last_eval


def acceptance(target: Target, target_dir: Path, checkpoint: Path, tokenizer, conversations, settings) -> dict:
    config = loading.load_config(target_dir)
    loaded = drafts.load_draft(checkpoint, config)
    draft = loaded.model
    if loaded.needs_embeddings:
        draft.copy_embeddings(target.model.get_input_embeddings().weight.float().cpu())
    draft.eval()
    accepted = steps = 0
    first = 0
    seconds = 0.0
    for i, conv in enumerate(conversations):
        conv.answers.clear()
        for turn in range(len(conv.turns)):
            g = generate(target, draft, prompts.prompt_ids(tokenizer, conv, turn), settings,
                         torch.Generator().manual_seed(1000 * i + turn) if settings.temperature > 0 else None)
            accepted += sum(m for m, _ in g.steps)
            steps += len(g.steps)
            first += sum(1 for m, _ in g.steps if m >= 1)
            seconds += g.seconds
            conv.answers.append(tokenizer.decode(g.tokens, skip_special_tokens=True).strip())
    return {"acceptance_length": 1 + accepted / max(1, steps), "first_position": first / max(1, steps),
            "steps": steps, "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", required=True, help="KEY=PATH (keys used by the variants)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="base,regen")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench questions (both turns)")
    parser.add_argument("--heldout", default=None, help="a chat file of prompts the draft was not tuned on")
    parser.add_argument("--heldout-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    set_quiet(True)
    datasets = dict(item.split("=", 1) for item in args.data)
    target = str(assets.ensure_all(install=False)["smollm2"])
    target_dir = loading.resolve_target(target)
    tokenizer = loading.load_tokenizer(target_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "recipe.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    checkpoints = {}
    for name in names:
        data, vocab, overrides, _ = VARIANTS[name]
        t0 = time.perf_counter()
        vmap, cache = prepare(args.out, data, datasets[data], vocab, target, args.max_length)
        steps = args.steps * (2 if name.endswith("-2x") else 1)
        checkpoints[name] = train_variant(args.out, name, vmap, cache, steps, args.batch_tokens, overrides)
        print(f"{name}: trained ({time.perf_counter() - t0:.0f} s)", flush=True)

    model = loading.load_model(target_dir, torch.device("cpu"), torch.float32)
    mt = prompts.load_conversations("mt-bench", args.prompts)
    held = prompts.load_conversations(args.heldout, args.heldout_prompts) if args.heldout else []
    for name in names:
        checkpoint, last_eval = checkpoints[name]
        temperature = VARIANTS[name][3]
        settings = Settings(depth=args.depth, topk=1, num_tokens=args.depth, temperature=temperature,
                            max_new_tokens=args.max_new_tokens,
                            eos_ids=eos_ids(tokenizer, loading.generation_config(target_dir)))
        config = loading.load_config(target_dir)
        target_m = Target(model, drafts.load_draft(checkpoint, config).model.config.aux_layer_ids)
        row = {"data": VARIANTS[name][0], "vocab": VARIANTS[name][1], "overrides": VARIANTS[name][2],
               "temperature": temperature, "steps": json.loads((checkpoint / "trainer_state.json").read_text())["step"],
               "heldout_top1": (last_eval.get("acc") or [None])[0],
               "mt_bench": acceptance(target_m, target_dir, checkpoint, tokenizer, mt, settings)}
        if held:
            row["heldout"] = acceptance(target_m, target_dir, checkpoint, tokenizer, held, settings)
        target_m.close()
        results[name] = row
        results_path.write_text(json.dumps(results, indent=2))
        print(name, json.dumps(row), flush=True)

    print("\n| variant | data | steps | held-out top-1 | MT-bench AL | first-pos | held-out AL |")
    print("|---|---|---|---|---|---|---|")
    for name, row in results.items():
        held_al = row.get("heldout", {}).get("acceptance_length")
        top1 = row["heldout_top1"]
        print(f"| {name} | {row['data']} | {row['steps']} | {top1:.3f} | "
              f"{row['mt_bench']['acceptance_length']:.2f} | {row['mt_bench']['first_position']:.2f} | "
              f"{held_al:.2f} |" if held_al is not None and top1 is not None else
              f"| {name} | {row['data']} | {row['steps']} | {top1} | {row['mt_bench']['acceptance_length']:.2f} | "
              f"{row['mt_bench']['first_position']:.2f} | - |")


if __name__ == "__main__":
    main()
