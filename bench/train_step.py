"""One EAGLE-3 TTT training step: spec_cli vs a score-materialising reference and the peers' own steps.

spec_cli against a plain reference that materialises the attention scores, and against the peers' own
training steps (speculators 0.9.0, SpecForge 0.2.0) where they are installed.

    python bench/train_step.py [--lengths 512,1024,2048,4096,8192] [--ref-max-len 4096] [--checkpoint]
                               [--peers speculators,specforge] [--peer-max-mb 8000] [--peer-max-step-s 60]

    pip install --no-deps speculators==0.9.0 specforge==0.2.0   # the peers (bench/peers.py says how
                                                                  # they are called on CPU)

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

Peers (bench/peers.py): the same draft's weights are copied into each peer's own draft class and the
peer's own TTT forward runs on the same batch (same ids, aux states, loss mask and target_p), 7 steps,
step weight 0.8, AdamW over the peer's trainable parameters. Before timing, each peer's per-step loss
(converted to spec_cli's soft-CE, mean over supervised slots), accuracy and gradients are checked
against spec_cli's on a short fp32 input. A peer run is stopped when its process passes
--peer-max-mb of RSS or a step takes longer than --peer-max-step-s, and the peer is not run at longer T.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
import tempfile
import time

import peers  # bench/peers.py (this script's folder is on sys.path)
import torch

SHAPE = dict(
    vocab_size=49152,
    target_hidden_size=576,
    aux_layer_ids=[1, 14, 26],
    target_num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    draft_vocab_size=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)


def build(T: int, seed: int = 0, supervised: float = 1.0):
    from spec_cli.batch import TargetBatch
    from spec_cli.draft.config import DraftConfig
    from spec_cli.draft.eagle3.model import Eagle3Draft

    torch.manual_seed(seed)
    cfg = DraftConfig(**SHAPE)
    draft = Eagle3Draft(cfg)
    selected = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
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
    positions = torch.arange(T).expand(B, T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]
    hidden = draft.project(batch.aux_hidden)
    cache_k, cache_v = [], []
    weights = [step_weight**k for k in range(ttt_steps)]
    total = 0.0
    for k in range(ttt_steps):
        ids = torch.cat([batch.input_ids[:, k:], batch.input_ids[:, :k] * 0], 1)
        cos, sin = draft.rope(
            positions + k
        )  # step k: slot t reads token t + k, at its position (serving's)
        x = torch.cat(
            [layer.input_layernorm(draft.embed_tokens(ids)), layer.hidden_norm(hidden)], -1
        )
        q, kk, v = attn.qkv(x, cos, sin)
        cache_k.append(kk.repeat_interleave(group, 1))
        cache_v.append(v.repeat_interleave(group, 1))
        scores = (
            q @ cache_k[0].transpose(-1, -2) / math.sqrt(attn.head_dim) + causal
        )  # [B, h, T, T]
        for kj in cache_k[1:]:
            scores = torch.cat(
                [scores, (q * kj).sum(-1, keepdim=True) / math.sqrt(attn.head_dim)], -1
            )
        p = scores.softmax(-1)  # [B, h, T, T + k]
        o = p[..., :T] @ cache_v[0]
        for j, vj in enumerate(cache_v[1:]):
            o = o + p[..., T + j, None] * vj
        h = hidden + attn.out(o)
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = draft.logits(hidden)  # [B, T, Vd]
        valid = torch.arange(T) < T - k
        mask = torch.zeros_like(batch.position_mask)
        mask[:, : T - k] = batch.position_mask[:, k:]
        target_p = torch.cat([batch.target_p[:, k:], batch.target_p[:, :k] * 0], 1)
        ce = -(target_p * logits.log_softmax(-1)).sum(-1)  # [B, T]
        total = total + weights[k] / sum(weights) * (
            ce * (mask & valid)
        ).sum() / mask.sum().clamp_min(1)
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


def worker(impl: str, T: int, iters: int, checkpoint: bool, supervised: float, args) -> dict:
    from spec_cli.draft.eagle3.ttt import ttt_forward

    draft, batch = build(T, supervised=supervised)
    model, loss_fn = draft, None
    if impl == "spec_cli":
        loss_fn = lambda: ttt_forward(draft, batch, ttt_steps=7, checkpoint=checkpoint).loss  # noqa: E731
    elif impl == "reference":
        loss_fn = lambda: reference_ttt(draft, batch, ttt_steps=7)  # noqa: E731
    elif impl == "speculators":
        model = peers.speculators_model(draft, args.speculators_attn, args.speculators_train_head)
        inputs = peers.speculators_inputs(batch)
        loss_fn = lambda: peers.speculators_step(model, inputs)[0]  # noqa: E731
    else:
        model = peers.specforge_model(draft)
        inputs = peers.specforge_inputs(batch, draft)
        loss_fn = lambda: peers.specforge_step(model, inputs)[0]  # noqa: E731
    if model is not draft:
        del draft  # the peer holds its own copy of the weights
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()

    baseline = reset_peak_rss()
    times, cpu_times = [], []
    for i in range(iters + 1):  # the first one warms up (and compiles, for SpecForge)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if impl in peers.PEERS and times[-1] > args.peer_max_step_s:
            return dict(
                impl=impl, T=T, error=f"too slow: {times[-1]:.0f} s/step", too_slow=times[-1]
            )
    best = min(times[1:])
    return dict(
        impl=impl,
        T=T,
        seconds=best,
        tokens_per_s=T / best,
        cpu_seconds=min(cpu_times[1:]),
        cpu_tokens_per_s=T / min(cpu_times[1:]),
        peak_mb=peak_rss_mb() - baseline,
        baseline_mb=baseline,
        threads=torch.get_num_threads(),
    )


def check_agreement() -> float:
    """spec_cli's TTT loss and gradients equal the reference's on a short input."""
    from spec_cli.draft.eagle3.ttt import ttt_forward

    draft, batch = build(64)
    draft = draft.double()
    batch.aux_hidden, batch.target_p = batch.aux_hidden.double(), batch.target_p.double()
    params = [p for p in draft.parameters() if p.requires_grad]
    ours = ttt_forward(draft, batch, ttt_steps=7).loss
    ref = reference_ttt(draft, batch, ttt_steps=7)
    g_ours = torch.autograd.grad(ours, params)
    g_ref = torch.autograd.grad(ref, params)
    err = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(g_ours, g_ref)
    )
    if abs(float((ours - ref).detach())) > 1e-9 or err > 1e-8:
        raise SystemExit(
            f"spec_cli and the reference disagree: loss {float(ours)} vs {float(ref)}, "
            f"worst relative gradient error {err:.2e}"
        )
    return err


def check_peers(names: list[str], args) -> None:
    """Each peer's loss, accuracy and gradients equal spec_cli's on one short input (fp32)."""
    tol = dict(ce=1e-4, acc=1e-6, grad=1e-4)
    print(
        f"peer check (T=64, fp32, 7 TTT steps, same weights and batch; tolerances: soft-CE {tol['ce']:.0e} "
        f"abs, accuracy {tol['acc']:.0e}, gradient {tol['grad']:.0e} relative to the largest entry):"
    )
    for name in names:
        r = peers.check(name, build, speculators_attn=args.speculators_attn)
        acc = (
            "n/a (speculators reports cumulative accuracy)"
            if r["acc_err"] is None
            else f"{r['acc_err']:.1e}"
        )
        print(
            f"  {name:<11} soft-CE per step {', '.join(f'{x:.5f}' for x in r['ce'])}\n"
            f"  {'spec_cli':<11} soft-CE per step {', '.join(f'{x:.5f}' for x in r['spec_cli_ce'])}\n"
            f"  {'':<11} max soft-CE diff {r['ce_err']:.1e}, accuracy diff {acc} (step accuracies "
            f"{', '.join(f'{x:.3f}' for x in r['acc'])}), gradient diff {r['grad_err']:.1e}\n"
            f"  {'':<11} vs ttt_forward as shipped: up to {r['shipped_err']:.1e}"
        )
        bad = [k for k in ("ce", "grad") if r[f"{k}_err"] > tol[k]]
        bad += ["acc"] if r["acc_err"] is not None and r["acc_err"] > tol["acc"] else []
        bad += ["shipped"] if r["shipped_err"] > tol["ce"] else []
        if bad:
            raise SystemExit(f"{name} and spec_cli disagree ({', '.join(bad)}): {json.dumps(r)}")
    print()


def _rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_one(impl: str, T: int, iters: int, checkpoint: bool, supervised: float, args=None) -> dict:
    """One (implementation, length) in a fresh process. Peers are watched: stopped above
    --peer-max-mb of RSS, or when the run outlasts its steps at --peer-max-step-s plus a minute."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        impl,
        "--lengths",
        str(T),
        "--iters",
        str(iters),
        "--supervised",
        str(supervised),
        "--threads",
        str(torch.get_num_threads()),
    ]
    cmd += ["--checkpoint"] if checkpoint else []
    watched = impl in peers.PEERS
    if watched:
        cmd += [
            "--speculators-attn",
            args.speculators_attn,
            "--peer-max-step-s",
            str(args.peer_max_step_s),
        ]
        cmd += ["--speculators-train-head"] if args.speculators_train_head else []
    limit_s = (iters + 1) * args.peer_max_step_s + 60 if watched else None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        t0, stopped, peak = time.perf_counter(), None, 0.0
        while proc.poll() is None:
            time.sleep(0.1)
            peak = max(peak, _rss_mb(proc.pid))
            if watched and peak > args.peer_max_mb:
                stopped = f"stopped: RSS > {args.peer_max_mb:,} MB"
            elif watched and time.perf_counter() - t0 > limit_s:
                stopped = f"stopped: > {args.peer_max_step_s} s/step"
            if stopped:
                proc.kill()
                proc.wait()
                return dict(impl=impl, T=T, error=stopped, stopped=True)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        return dict(impl=impl, T=T, error=(stderr.strip().splitlines() or ["killed"])[-1])
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument(
        "--ref-max-len",
        type=int,
        default=4096,
        help="skip the reference above this length (its scores grow as T^2: at 8192 "
        "they alone need ~17 GB per unroll); 0: no reference",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=0,
        help="timed steps per run (0: 3 up to 1024, 2 up to 2048, else 1), after one warm-up",
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="spec_cli with activation checkpointing"
    )
    parser.add_argument(
        "--supervised",
        type=float,
        default=1.0,
        help="fraction of positions with a loss (chat data: ~0.5; 1.0 is the worst case)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--peers",
        default=",".join(peers.PEERS),
        help="peers to run where installed (comma-separated; empty: none)",
    )
    parser.add_argument(
        "--peer-max-mb",
        type=int,
        default=8000,
        help="stop a peer's run when its process RSS passes this",
    )
    parser.add_argument(
        "--peer-max-step-s",
        type=float,
        default=60.0,
        help="stop a peer's run when one step takes longer than this",
    )
    parser.add_argument(
        "--speculators-attn",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="speculators' draft attention (its flex attention has no CPU backward)",
    )
    parser.add_argument(
        "--speculators-train-head",
        action="store_true",
        help="train speculators' draft lm_head like spec_cli does (frozen as shipped)",
    )
    parser.add_argument(
        "--worker", choices=["spec_cli", "reference", *peers.PEERS], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.worker:
        print(
            json.dumps(
                worker(
                    args.worker,
                    lengths[0],
                    max(args.iters, 1),
                    args.checkpoint,
                    args.supervised,
                    args,
                )
            )
        )
        return

    err = check_agreement()
    print(f"agreement check (T=64, fp64, 7 TTT steps): loss equal, worst gradient error {err:.1e}")
    wanted = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(wanted) - set(peers.PEERS))
    if unknown:
        raise SystemExit(f"unknown peers {unknown}: choose from {', '.join(peers.PEERS)}")
    names = []
    for name in wanted:
        reason = peers.missing(name)
        print(f"peer {name}: {reason}" if reason else f"peer {name}: {peers.version(name)}")
        names += [] if reason else [name]
    if names:
        check_peers(names, args)
    print(
        f"threads: {torch.get_num_threads()}, checkpoint: {args.checkpoint}, "
        f"supervised fraction: {args.supervised}, speculators attention: {args.speculators_attn}, "
        f"speculators lm_head: {'trained' if args.speculators_train_head else 'frozen (as shipped)'}, "
        f"specforge attention: sdpa\n"
    )
    impls = ["spec_cli"] + (["reference"] if args.ref_max_len else []) + names
    header = (
        f"{'T':>6} {'implementation':<14} | {'tok/s':>7} {'cpu tok/s':>9} {'peak MB':>8} "
        f"| {'spec_cli/x:':>11} {'speed':>6} {'cpu':>6} {'memory':>7}"
    )
    print(header)
    print("-" * len(header))
    rows, gave_up = [], {}
    for T in lengths:
        iters = args.iters or (3 if T <= 1024 else 2 if T <= 2048 else 1)
        res = {}
        for impl in impls:
            if impl == "reference" and T > args.ref_max_len:
                res[impl] = dict(skipped=f"skipped: > --ref-max-len {args.ref_max_len}")
            elif impl in gave_up:
                res[impl] = dict(skipped=f"skipped (stopped at {gave_up[impl]})")
            else:
                res[impl] = run_one(
                    impl, T, iters, args.checkpoint and impl == "spec_cli", args.supervised, args
                )
                if impl in peers.PEERS and "error" in res[impl]:
                    gave_up[impl] = T
            print(
                f"{T:>6} {impl:<14} | {_cols(res[impl])} | {_ratios(res['spec_cli'], res[impl])}",
                flush=True,
            )
        rows.append((T, res))
    print(
        "\nspeed: spec_cli tokens/s over the other's (wall clock, best step); cpu: the same from process "
        "CPU time\n(robust to other processes sharing the cores); memory: the other's peak over spec_cli's"
    )
    print(
        "peak MB: peak RSS of a fresh process during the steps minus its RSS after building model + batch"
    )
    for impl in impls:
        done = [(T, r[impl]["peak_mb"]) for T, r in rows if "peak_mb" in r[impl]]
        slopes = [
            f"{t0}->{t1}: {(m1 - m0) / (t1 - t0) * 1024:.0f}"
            for (t0, m0), (t1, m1) in zip(done, done[1:])
        ]
        if slopes:  # constant when memory grows linearly in T, rising when it grows faster
            print(f"{impl} peak memory per extra token (KB): " + ", ".join(slopes))
    skipped = [T for T, r in rows if "skipped" in r.get("reference", {})]
    if skipped:
        print(
            f"reference skipped at T = {skipped} (its [1, 9, T, T+7] fp32 scores per step grow as T^2)"
        )


def _cols(r: dict) -> str:
    if "tokens_per_s" in r:
        return f"{r['tokens_per_s']:7,.0f} {r['cpu_tokens_per_s']:9,.0f} {r['peak_mb']:8,.0f}"
    return f"{r.get('error', r.get('skipped', ''))[:26]:>26}"


def _ratios(ours: dict, other: dict) -> str:
    if other is ours or "tokens_per_s" not in ours or "tokens_per_s" not in other:
        return ""
    return (
        f"{'':>11} {ours['tokens_per_s'] / other['tokens_per_s']:5.2f}x "
        f"{other['cpu_seconds'] / ours['cpu_seconds']:5.2f}x "
        f"{other['peak_mb'] / max(ours['peak_mb'], 1):6.1f}x"
    )


if __name__ == "__main__":
    main()
