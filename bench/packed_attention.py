"""Packed TTT attention, forward + backward over all TTT steps: the dense [B, 1, T, T] block-causal
bias, one causal kernel call per document (`Segments` on CPU, or on CUDA without varlen), and one
varlen kernel call per batch (CUDA's default for packed rows).

    python bench/packed_attention.py [--row N] [--doc N] [--steps 3] [--repeats 5] [--dtype bf16]

A row of --row slots holds documents of about --doc tokens; each TTT step adds one extra key per
position, as in training. Defaults: on CPU SmolLM2-135M's heads (9 / 3, d 64), a 2048-slot row of
~234-token documents (the demo's packed rows), fp32; on CUDA Llama-3.1-8B's (32 / 8, d 128), an
8192-slot row of ~136-token documents (60 per row), bf16. Every variant's gradients are first checked
against the first variant's (relative norm) before any timing. The table gives the median seconds per pass and the
attention kernel calls per pass counted by torch.profiler (plus all CUDA kernels launched on a GPU),
and the ratio of each variant to the per-document loop.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spec_cli.draft import attention  # noqa: E402
from spec_cli.draft.attention import Segments, block_causal_bias, ttt_attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def doc_lengths(row: int, doc: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while used < row:
        n = int(torch.randint(doc // 2, doc * 3 // 2 + 1, (1,), generator=gen))
        n = min(n, row - used)
        lengths.append(n)
        used += n
    return torch.tensor([lengths])


def one_pass(bias, q, k0, v0, extra, steps):
    grads = []
    for n in range(steps):  # TTT step n attends the step-0 prefix plus n extra keys per position
        out = ttt_attention(q, k0, v0, extra[0][:n], extra[1][:n], bias)
        grads.append(torch.autograd.grad(out.float().square().sum(), [q, k0, v0]))
    return grads


@contextlib.contextmanager
def per_document():
    """Packed rows once per document, as without a varlen kernel."""
    real = attention.varlen_kernel
    attention.varlen_kernel = lambda kernel, device, dtype: None
    try:
        yield
    finally:
        attention.varlen_kernel = real


def launches(run, device: torch.device) -> tuple[int, int | None]:
    """(attention kernel calls, all CUDA kernels or None on CPU) in one call of `run`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()

    def attention_op(e) -> bool:
        return e is not None and e.name.startswith("aten::_") and "attention" in e.name

    # top-level calls only: on CUDA aten::_scaled_dot_product_efficient_attention calls
    # aten::_efficient_attention_forward inside, which would count each call twice
    calls = sum(1 for e in events if attention_op(e) and not attention_op(e.cpu_parent))
    kernels = None
    if device.type == "cuda":
        kernels = sum(
            1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        )
    return calls, kernels


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--row", type=int, default=None)
    parser.add_argument("--doc", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--no-dense", action="store_true", help="skip the dense bias (O(T^2) memory)"
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    heads, kv_heads, d = (32, 8, 128) if cuda else (9, 3, 64)
    row, doc = args.row or (8192 if cuda else 2048), args.doc or (136 if cuda else 234)
    seq_lens = doc_lengths(row, doc, seed=0)
    gen = torch.Generator().manual_seed(0)

    def rand(h):
        return torch.randn(1, h, row, d, generator=gen).to(device, dtype).requires_grad_()

    q, k0, v0 = rand(heads), rand(kv_heads), rand(kv_heads)
    extra = (
        [rand(kv_heads) for _ in range(args.steps)],
        [rand(kv_heads) for _ in range(args.steps)],
    )
    segments = Segments.from_seq_lens(seq_lens, row)
    variants = {"per document": (segments, per_document)}
    if cuda:
        kernel = attention.pick_kernel(device, dtype)
        variants["one varlen call"] = (segments, contextlib.nullcontext)
        print(f"packed rows run on: {attention.packed_kernel_name(kernel, device, dtype)}")
    if not args.no_dense:
        variants["dense bias"] = (
            block_causal_bias(seq_lens.to(device), row, dtype),
            contextlib.nullcontext,
        )

    tol = (
        1e-4 if dtype == torch.float32 else 1e-2
    )  # relative to the gradient's norm: 16-bit kernels round apart
    results = {}
    for name, (bias, context) in variants.items():
        with context():
            got = one_pass(bias, q, k0, v0, extra, args.steps)
            if results:
                ref = next(iter(results.values()))["grads"]
                for a, b in zip(ref, got):
                    for x, y in zip(a, b):
                        error = float((x.float() - y.float()).norm() / y.float().norm())
                        if error > tol:
                            raise AssertionError(
                                f"{name}: gradients differ from the first variant's by {error:.2e} "
                                f"(relative norm; over {tol})"
                            )
            times = []
            for _ in range(args.repeats):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                one_pass(bias, q, k0, v0, extra, args.steps)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            calls, kernels = launches(lambda: one_pass(bias, q, k0, v0, extra, args.steps), device)
        results[name] = {
            "grads": got,
            "seconds": statistics.median(times),
            "calls": calls,
            "kernels": kernels,
        }
    docs = seq_lens.shape[1]
    print(
        f"{device.type} {str(dtype).replace('torch.', '')}: row {row} slots, {docs} documents (mean "
        f"{row / docs:.0f}), heads {heads}/{kv_heads} d {d}, TTT {args.steps}, {torch.get_num_threads()} "
        "threads; gradients agree"
    )
    base = results["per document"]["seconds"]
    print(
        "| attention | s per fwd+bwd (all steps) | attention kernel calls | CUDA kernels | vs per document |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        kernels = "-" if r["kernels"] is None else r["kernels"]
        print(
            f"| {name} | {r['seconds']:.4f} | {r['calls']} | {kernels} | {base / r['seconds']:.2f}x |"
        )
    return {name: {k: v for k, v in r.items() if k != "grads"} for name, r in results.items()}


if __name__ == "__main__":
    main()
