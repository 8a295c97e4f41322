"""One EAGLE-3 TTT training step: spec_cli vs a plain reference that materialises the attention scores.

    python bench/train_step.py [--lengths 512,1024,2048,4096,8192] [--ref-max-len 4096] [--checkpoint]

SmolLM2-135M-shaped draft (H 576, 9 heads, 3 kv heads, head_dim 64, intermediate 1536, target vocab
49152, draft vocab 8192), CPU fp32, batch 1, random inputs, 7 TTT steps, AdamW step included.
The reference is written here, after SpecForge's eager path: per step it builds the full
[B, heads, T, T + k] score tensor (step-0 causal scores with the per-position scores of steps 1..k
concatenated), a softmax over it, and full [B, T, Vd] logits. Both share the draft's weights and
layer code, so they differ only in attention and in where the loss head runs.

Each (implementation, length) runs in a fresh subprocess. Peak memory: after building the model,
optimizer and batch, the process's peak-RSS counter is reset (Linux clear_refs) and its RSS taken as
the baseline; the figure is the peak RSS over the timed steps minus that baseline.
Before timing, the two implementations' losses and gradients are checked to agree on a short input.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
import time

import torch

SHAPE = dict(vocab_size=49152, target_hidden_size=576, aux_layer_ids=[1, 14, 26], target_num_layers=30,
             hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
             head_dim=64, draft_vocab_size=8192, rope_theta=100000.0, rms_norm_eps=1e-5)


def build(T: int, seed: int = 0, supervised: float = 1.0):
    from spec_cli.draft.config import DraftConfig
    from spec_cli.draft.model import Eagle3Draft
    from spec_cli.target.batch import TargetBatch

    torch.manual_seed(seed)
    cfg = DraftConfig(**SHAPE)
    draft = Eagle3Draft(cfg)
    selected = torch.sort(torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size]).values
    draft.set_vocab_map(selected)
    B, Vd = 1, cfg.draft_vocab_size
    loss_mask = (torch.rand(B, T) < supervised).long()
    loss_mask[:, -1] = 0
    target_p = (torch.randn(B, T, Vd) * 2).softmax(-1)
    target_ids = selected[target_p.argmax(-1)]
    batch = TargetBatch(
        aux_hidden=torch.randn(B, T, 3 * cfg.target_hidden_size),
        input_ids=torch.randint(0, cfg.vocab_size, (B, T)),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        loss_mask=loss_mask,
        target_p=target_p,
        position_mask=loss_mask.bool(),
        target_ids=target_ids,
        target_mass=torch.rand(B, T) * 0.5 + 0.5,
    )
    return draft, batch


# ---------------------------------------------------------------------------------------------
# the reference: SpecForge-style eager TTT attention and full-vocab-width logits


def reference_ttt(draft, batch, ttt_steps: int = 7, step_weight: float = 0.8) -> torch.Tensor:
    layer = draft.midlayer
    attn = layer.self_attn
    B, T = batch.input_ids.shape
    group = attn.heads // attn.kv_heads
    cos, sin = draft.rope(torch.arange(T).expand(B, T))
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]
    hidden = draft.project(batch.aux_hidden)
    cache_k, cache_v = [], []
    weights = [step_weight ** k for k in range(ttt_steps)]
    total = 0.0
    for k in range(ttt_steps):
        ids = torch.cat([batch.input_ids[:, k:], batch.input_ids[:, :k] * 0], 1)
        x = torch.cat([layer.input_layernorm(draft.embed_tokens(ids)), layer.hidden_norm(hidden)], -1)
        q, kk, v = attn.qkv(x, cos, sin)
        cache_k.append(kk.repeat_interleave(group, 1))
        cache_v.append(v.repeat_interleave(group, 1))
        scores = q @ cache_k[0].transpose(-1, -2) / math.sqrt(attn.head_dim) + causal  # [B, h, T, T]
        for kj in cache_k[1:]:
            scores = torch.cat([scores, (q * kj).sum(-1, keepdim=True) / math.sqrt(attn.head_dim)], -1)
        p = scores.softmax(-1)  # [B, h, T, T + k]
        o = p[..., :T] @ cache_v[0]
        for j, vj in enumerate(cache_v[1:]):
            o = o + p[..., T + j, None] * vj
        h = hidden + attn.out(o)
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = draft.logits(hidden)  # [B, T, Vd]
        valid = torch.arange(T) < T - k
        mask = torch.zeros_like(batch.position_mask)
        mask[:, :T - k] = batch.position_mask[:, k:]
        target_p = torch.cat([batch.target_p[:, k:], batch.target_p[:, :k] * 0], 1)
        ce = -(target_p * logits.log_softmax(-1)).sum(-1)  # [B, T]
        total = total + weights[k] / sum(weights) * (ce * (mask & valid)).sum() / mask.sum().clamp_min(1)
    return total


# ---------------------------------------------------------------------------------------------


def _status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def reset_peak_rss() -> float:
    """Start a new peak-RSS window (Linux clear_refs 5) and return the current RSS in MB: the
    baseline of a process that has only built the model, the optimizer and the batch. Where the
    reset is not allowed, the baseline is the peak so far (which under-counts small runs)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_mb("VmRSS")
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """Peak RSS of this process. VmHWM, not ru_maxrss: after fork + exec, ru_maxrss also counts the
    parent's peak."""
    try:
        return _status_mb("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(impl: str, T: int, iters: int, checkpoint: bool, supervised: float) -> dict:
    from spec_cli.draft.ttt import ttt_forward

    draft, batch = build(T, supervised=supervised)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        if impl == "spec_cli":
            loss = ttt_forward(draft, batch, ttt_steps=7, checkpoint=checkpoint).loss
        else:
            loss = reference_ttt(draft, batch, ttt_steps=7)
        loss.backward()
        opt.step()

    baseline = reset_peak_rss()
    times, cpu_times = [], []
    for i in range(iters + 1):  # the first one warms up
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    best = min(times[1:])
    return dict(impl=impl, T=T, seconds=best, tokens_per_s=T / best, cpu_seconds=min(cpu_times[1:]),
                peak_mb=peak_rss_mb() - baseline, baseline_mb=baseline, threads=torch.get_num_threads())


def check_agreement() -> float:
    """spec_cli's TTT loss and gradients equal the reference's on a short input."""
    from spec_cli.draft.ttt import ttt_forward

    draft, batch = build(64)
    draft = draft.double()
    batch.aux_hidden, batch.target_p = batch.aux_hidden.double(), batch.target_p.double()
    params = [p for p in draft.parameters() if p.requires_grad]
    ours = ttt_forward(draft, batch, ttt_steps=7).loss
    ref = reference_ttt(draft, batch, ttt_steps=7)
    g_ours = torch.autograd.grad(ours, params)
    g_ref = torch.autograd.grad(ref, params)
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(g_ours, g_ref))
    if abs(float((ours - ref).detach())) > 1e-9 or err > 1e-8:
        raise SystemExit(f"spec_cli and the reference disagree: loss {float(ours)} vs {float(ref)}, "
                         f"worst relative gradient error {err:.2e}")
    return err


def run_one(impl: str, T: int, iters: int, checkpoint: bool, supervised: float) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, "--lengths", str(T), "--iters", str(iters),
           "--supervised", str(supervised), "--threads", str(torch.get_num_threads())]
    cmd += ["--checkpoint"] if checkpoint else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return dict(impl=impl, T=T, error=(proc.stderr.strip().splitlines() or ["killed"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--ref-max-len", type=int, default=4096,
                        help="skip the reference above this length (its scores grow as T^2: at 8192 "
                             "they alone need ~17 GB per unroll)")
    parser.add_argument("--iters", type=int, default=0, help="timed steps per run (0: 3 up to 1024, "
                                                             "2 up to 2048, else 1), after one warm-up")
    parser.add_argument("--checkpoint", action="store_true", help="spec_cli with activation checkpointing")
    parser.add_argument("--supervised", type=float, default=1.0,
                        help="fraction of positions with a loss (chat data: ~0.5; 1.0 is the worst case)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--worker", choices=["spec_cli", "reference"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.worker:
        print(json.dumps(worker(args.worker, lengths[0], max(args.iters, 1), args.checkpoint,
                                args.supervised)))
        return

    err = check_agreement()
    print(f"agreement check (T=64, fp64, 7 TTT steps): loss equal, worst gradient error {err:.1e}")
    print(f"threads: {torch.get_num_threads()}, checkpoint: {args.checkpoint}, "
          f"supervised fraction: {args.supervised}\n")
    header = (f"{'T':>6} | {'spec_cli tok/s':>14} {'peak MB':>9} | {'reference tok/s':>15} {'peak MB':>9} "
              f"| {'speed':>6} {'cpu':>6} {'memory':>7}")
    print(header)
    print("-" * len(header))
    rows = []
    for T in lengths:
        iters = args.iters or (3 if T <= 1024 else 2 if T <= 2048 else 1)
        ours = run_one("spec_cli", T, iters, args.checkpoint, args.supervised)
        ref = (run_one("reference", T, iters, False, args.supervised) if T <= args.ref_max_len
               else dict(skipped=f"skipped above --ref-max-len {args.ref_max_len}"))
        rows.append((T, ours, ref))

        def cols(r):
            if "tokens_per_s" in r:
                return f"{r['tokens_per_s']:14,.0f} {r['peak_mb']:9,.0f}"
            return f"{r.get('error', r.get('skipped', ''))[:24]:>24}"

        ratio = ""
        if "tokens_per_s" in ours and "tokens_per_s" in ref:
            ratio = (f"{ours['tokens_per_s'] / ref['tokens_per_s']:5.2f}x "
                     f"{ref['cpu_seconds'] / ours['cpu_seconds']:5.2f}x "
                     f"{ref['peak_mb'] / max(ours['peak_mb'], 1):6.1f}x")
        print(f"{T:>6} | {cols(ours)} | {cols(ref):>25} | {ratio}", flush=True)
    print("\nspeed: spec_cli tokens/s over the reference's (wall clock, best step); cpu: the same from "
          "process CPU time\n(robust to other processes sharing the cores); memory: reference peak over "
          "spec_cli peak")
    print("peak MB: peak RSS of a fresh process during the steps minus its RSS after building model + batch")
    for name, col in (("spec_cli", 1), ("reference", 2)):
        done = [(r[0], r[col]["peak_mb"]) for r in rows if "peak_mb" in r[col]]
        slopes = [f"{t0}->{t1}: {(m1 - m0) / (t1 - t0) * 1024:.0f}"
                  for (t0, m0), (t1, m1) in zip(done, done[1:])]
        if slopes:  # constant when memory grows linearly in T, rising when it grows faster
            print(f"{name} peak memory per extra token (KB): " + ", ".join(slopes))
    skipped = [T for T, _, r in rows if "skipped" in r]
    if skipped:
        print(f"reference skipped at T = {skipped} (its [1, 9, T, T+7] fp32 scores per step grow as T^2)")


if __name__ == "__main__":
    main()
