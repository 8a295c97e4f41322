"""What `spec precompute --storage-dtype bf16` saves and what it costs, on a real target (CPU, fp32).

    python bench/storage_dtype.py [--target smollm2] [--samples 32] [--max-length 256] [--steps 30]

The first --records records of the data (default 4 x --samples) are all that is tokenised: the vocab
map is counted over them and the caches hold the first --samples usable samples.

The same fp32 target pass is cached twice, with --storage-dtype fp32 (the default on CPU) and bf16, and
compared the way the trainer sees them (CacheBackend.generate_batch over every batch of the plan):

1. size: bytes/token, shard bytes, head bytes, everything in the folder;
2. supervision: target_p max abs difference, KL(p_fp32 || p_bf16) per supervised position (mean,
   max), agreement of the draft-vocab argmax of target_p, position_mask equality (stored argmax), and
   the relative error of the aux hidden states;
3. training: `spec train` for --steps steps from each cache, same seed and options: the train loss at
   every step and the final held-out eval.

Everything is written under a temporary folder (its SPEC_HOME too); the assets are only read.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from spec_cli import assets
from spec_cli.artifacts import feature_cache as fc
from spec_cli.data.batching import collate
from spec_cli.stages import build_vocab_map, precompute, train
from spec_cli.targets.cache_backend import CacheBackend


def supervision_diff(full: Path, half: Path) -> dict:
    """Batch by batch over the cache's plan: how far the bf16 cache's supervision is from the fp32 one."""
    a, b = CacheBackend(full), CacheBackend(half)
    tokens, plan = a.tokens(), a.plan()
    assert plan == b.plan()
    max_abs, kl_sum, kl_max, agree, positions, aux_err, aux_norm = 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0
    masks_equal = True
    for indices in plan:
        ids, am, lm = collate(tokens, indices)
        x, y = a.generate_batch(ids, am, lm), b.generate_batch(ids, am, lm)
        masks_equal &= bool(torch.equal(x.position_mask, y.position_mask))
        sup = x.position_mask  # [B, T] the positions that carry loss
        p, q = x.target_p[sup], y.target_p[sup]  # [n, Vd]
        max_abs = max(max_abs, float((p - q).abs().max()) if p.numel() else 0.0)
        kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)  # [n]
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()) if kl.numel() else 0.0)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        positions += int(sup.sum())
        real = am.bool()
        aux_err += float((x.aux_hidden[real] - y.aux_hidden[real]).float().pow(2).sum())
        aux_norm += float(x.aux_hidden[real].float().pow(2).sum())
    a.close()
    b.close()
    return {
        "positions": positions,
        "target_p_max_abs": max_abs,
        "kl_mean": kl_sum / max(positions, 1),
        "kl_max": kl_max,
        "argmax_agreement": agree / max(positions, 1),
        "position_mask_equal": masks_equal,
        "aux_rel_rms": (aux_err / max(aux_norm, 1e-30)) ** 0.5,
    }


def train_losses(
    cache: Path, vocab_map: Path, out: Path, steps: int, batch_tokens: int, ttt: int
) -> dict:
    result = train.run(
        train.TrainConfig.from_options(
            vocab_map=vocab_map,
            output=out,
            cache=cache,
            ttt_steps=ttt,
            max_steps=steps,
            log_every=1,
            eval_every=steps,
            save_every=steps,
            batch_tokens=batch_tokens,
            eval_fraction=0.1,
            lr=3e-4,
            seed=0,
        )
    )
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    return {
        "losses": losses,
        "eval": result.final_eval,
        "seconds": result.seconds,
        "checkpoint_bytes": sum(
            p.stat().st_size for p in result.checkpoint.rglob("*") if p.is_file()
        ),
        "frozen_bytes": (out / "frozen.safetensors").stat().st_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument(
        "--chat-template", default=None, help="for a base model (e.g. gemma for gemma3-270m)"
    )
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument(
        "--records", type=int, default=None, help="records of the data read (4 x --samples)"
    )
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--draft-vocab-size", type=int, default=4096)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--encoding", default="hidden", choices=fc.ENCODINGS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ttt-steps", type=int, default=3)
    args = parser.parse_args()

    target = assets.resolve_target_arg(args.target)  # read from the user's SPEC_HOME, never written
    work = Path(tempfile.mkdtemp(prefix="spec-storage-dtype-"))
    data = str(work / "data.jsonl")
    with open(assets.resolve_data_arg(args.data)) as src, open(data, "w") as dst:
        for _, line in zip(range(args.records or 4 * args.samples), src):
            dst.write(line)
    os.environ["SPEC_HOME"] = str(work / "home")  # tokenisation cache, fingerprints: not the user's
    torch.manual_seed(0)
    vm = work / "vm.safetensors"
    build_vocab_map.run(
        build_vocab_map.BuildVocabMapConfig(
            target=target,
            data=data,
            output=vm,
            draft_vocab_size=args.draft_vocab_size,
            max_length=args.max_length,
            chat_template=args.chat_template,
        )
    )

    caches, sizes = {}, {}
    for storage in ("fp32", "bf16"):
        out = work / f"cache-{storage}"
        start = time.perf_counter()
        result = precompute.run(
            precompute.PrecomputeConfig(
                target=target,
                data=data,
                vocab_map=vm,
                output=out,
                encoding=args.encoding,
                dtype="fp32",
                storage_dtype=storage,
                batch_tokens=args.batch_tokens,
                max_length=args.max_length,
                max_samples=args.samples,
                chat_template=args.chat_template,
                resume=False,
                device="cpu",
            )
        )
        m = result.manifest
        caches[storage] = out
        sizes[storage] = {
            "bytes_per_token": m["bytes_per_token"],
            "tokens": m["num_tokens"],
            "shard_bytes": m["bytes"],
            "head_bytes": m["head_bytes"],
            "total": result.disk["total"],
            "estimated": result.estimated_bytes,
            "seconds": time.perf_counter() - start,
        }

    diff = supervision_diff(caches["fp32"], caches["bf16"])
    runs = {
        s: train_losses(
            caches[s], vm, work / f"run-{s}", args.steps, args.batch_tokens, args.ttt_steps
        )
        for s in ("fp32", "bf16")
    }

    m = fc.read_manifest(caches["fp32"])
    print(
        f"\n{Path(target).name}: H {m['hidden_size']}, V {m['vocab_size']}, Vd {m['draft_vocab_size']}, "
        f"encoding {args.encoding}, {args.samples} samples (max length {args.max_length}), "
        f"{m['num_tokens']} tokens, fp32 target on CPU"
    )
    print(
        f"{'storage':8s} {'bytes/token':>12s} {'shards':>12s} {'head':>12s} {'folder':>12s} {'estimate':>12s}"
    )
    for s, z in sizes.items():
        print(
            f"{s:8s} {z['bytes_per_token']:12d} {z['shard_bytes']:12d} {z['head_bytes']:12d} {z['total']:12d} "
            f"{z['estimated']:12d}"
        )
    print(
        f"bf16 / fp32: bytes/token {sizes['bf16']['bytes_per_token'] / sizes['fp32']['bytes_per_token']:.3f}, "
        f"shards {sizes['bf16']['shard_bytes'] / sizes['fp32']['shard_bytes']:.3f}"
    )
    print(f"\nsupervision, bf16 vs fp32 cache, at {diff['positions']} supervised positions:")
    print(f"  target_p max |diff|          {diff['target_p_max_abs']:.3e}")
    print(f"  KL(p_fp32 || p_bf16) mean    {diff['kl_mean']:.3e} nats   max {diff['kl_max']:.3e}")
    print(f"  argmax of target_p agrees    {diff['argmax_agreement']:.4%}")
    print(
        f"  position_mask identical      {diff['position_mask_equal']} (argmax stored from the fp32 pass)"
    )
    print(f"  aux hidden relative RMS err  {diff['aux_rel_rms']:.3e}")
    a, b = runs["fp32"]["losses"], runs["bf16"]["losses"]
    gaps = [abs(x - y) for x, y in zip(a, b)]
    print(f"\n{args.steps} training steps (TTT {args.ttt_steps}, same seed), train loss per step:")
    for k in sorted({0, len(a) // 4, len(a) // 2, 3 * len(a) // 4, len(a) - 1}):
        print(f"  step {k + 1:3d}: fp32 {a[k]:.5f}  bf16 {b[k]:.5f}  |diff| {gaps[k]:.2e}")
    print(
        f"  max |diff| over all steps {max(gaps):.3e}, relative {max(g / x for g, x in zip(gaps, a)):.3e}"
    )
    for s, r in runs.items():
        e = r["eval"] or {}
        acc = " ".join(f"{v:.4f}" for v in e.get("acc", []))
        print(
            f"  eval {s}: loss {e.get('loss', float('nan')):.5f}  acc {acc}  sim. acceptance "
            f"{e.get('acceptance_length', float('nan')):.4f}"
        )
    r = runs["fp32"]
    print(
        f"\ncheckpoint folder {r['checkpoint_bytes']} bytes; frozen.safetensors (once per run) "
        f"{r['frozen_bytes']} bytes"
    )
    print(f"(work folder: {work})")


if __name__ == "__main__":
    main()
