"""One P-EAGLE training step (COD sampling, segments) against EAGLE-3's TTT step of the same depth.

    python bench/peagle_step.py [--lengths 512,2048] [--depths 8] [--steps 3] [--segments 4]

SmolLM2-135M-shaped draft (bench/train_step.py's SHAPE), CPU fp32, one packed row of documents of
256 tokens, random aux states and target distributions, AdamW step included. Per length it runs, each
in a fresh subprocess (peak RSS over the timed steps minus the RSS after setup, as train_step.py):

    eagle3       TTT unroll of K steps (the baseline)
    peagle-all   P-EAGLE, every valid element at every depth (no COD sampling)
    peagle-cod   P-EAGLE with COD (0.7, floor 0.2), spec train's default
    peagle-seg   the same with --peagle-segments S (one forward + backward per segment)

and prints each one's seconds per step and peak MB with the ratio to eagle3 measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from train_step import SHAPE, peak_rss_mb, reset_peak_rss  # bench/train_step.py

KINDS = ("eagle3", "peagle-all", "peagle-cod", "peagle-seg")


def _batch(config, T: int, seed: int = 0):
    from spec_cli.batch import TargetBatch

    g = torch.Generator().manual_seed(seed)
    docs = [256] * (T // 256) + ([T % 256] if T % 256 else [])
    Vd = config.draft_vocab_size
    target_p = torch.randn(1, T, Vd, generator=g).softmax(-1)
    return TargetBatch(
        aux_hidden=torch.randn(1, T, 3 * config.target_hidden_size, generator=g),
        input_ids=torch.randint(0, config.vocab_size, (1, T), generator=g),
        attention_mask=torch.ones(1, T, dtype=torch.long),
        loss_mask=torch.ones(1, T, dtype=torch.long),
        target_p=target_p,
        target_mass=torch.ones(1, T),
        position_mask=torch.ones(1, T, dtype=torch.bool),
        target_ids=target_p.argmax(-1),
        seq_lens=torch.tensor([docs]),
    )


def one(kind: str, T: int, depths: int, steps: int, segments: int) -> dict:
    from spec_cli.draft import algorithms
    from spec_cli.draft.config import DraftConfig
    from spec_cli.train_options import ObjectiveOptions

    torch.manual_seed(0)
    name = "eagle3" if kind == "eagle3" else "peagle"
    config = DraftConfig(**SHAPE, algorithm=name, mask_token_id=0 if name == "peagle" else None)
    algorithm = algorithms.get(name)
    draft = algorithm.build(config)
    options = ObjectiveOptions(
        ttt_steps=depths,
        cod_ratio=1.0 if kind == "peagle-all" else 0.7,
        cod_min=1.0 if kind == "peagle-all" else 0.2,
        peagle_segments=segments if kind == "peagle-seg" else 1,
    )
    objective = algorithm.objective(draft, options).train()
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    batch = _batch(config, T)

    def step():
        for unit in objective.plan(batch):
            objective(batch, unit).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up (kernels, optimizer state)
    base = reset_peak_rss()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    peak = peak_rss_mb() - base
    return {"kind": kind, "T": T, "seconds": seconds, "peak_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--depths", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        kind, T = args.one.split(":")
        print(json.dumps(one(kind, int(T), args.depths, args.steps, args.segments)))
        return
    print(
        f"P-EAGLE vs EAGLE-3 training step, K = {args.depths}, CPU fp32, {torch.get_num_threads()} threads"
    )
    print(f"{'T':>6} {'kind':<11} {'s/step':>8} {'x eagle3':>9} {'peak MB':>9} {'x eagle3':>9}")
    for T in (int(x) for x in args.lengths.split(",")):
        rows = {}
        for kind in KINDS:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    f"{kind}:{T}",
                    "--depths",
                    str(args.depths),
                    "--steps",
                    str(args.steps),
                    "--segments",
                    str(args.segments),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            rows[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        ref = rows["eagle3"]
        for kind, r in rows.items():
            label = kind if kind != "peagle-seg" else f"peagle-seg{args.segments}"
            print(
                f"{T:>6} {label:<11} {r['seconds']:>8.3f} {r['seconds'] / ref['seconds']:>8.2f}x "
                f"{r['peak_mb']:>9.0f} {r['peak_mb'] / max(ref['peak_mb'], 1):>8.2f}x"
            )


if __name__ == "__main__":
    main()
