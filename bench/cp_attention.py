"""Context parallelism's attention traffic: the all-gather spec_cli runs vs Ulysses and ring attention.

    python bench/cp_attention.py [--tokens 8192] [--ranks 2] [--ttt-steps 3] [--repeats 5]
                                 [--heads 32] [--kv-heads 8] [--head-dim 128] [--dtype bf16]

Under `spec train --context-parallel N` each rank holds T/N slots of a row. At every TTT step the
draft's attention reads the step-0 keys and values of the whole row (each slot's later-step keys are
its own and stay local). Ways to move them, per draft layer and batch (an unroll of --ttt-steps):

- gather (spec_cli, spec_cli/draft/context.py): the step-0 keys and values all-gathered once and kept
  for the unroll; backward, their gradients (summed over the steps) reduce-scattered once, in fp32.
- gather-each-step: the same collectives at every step, forward and again backward (spec_cli's form
  before the keys were kept: the gathered keys lived only inside one attention call).
- ulysses: per step, all-to-all of q, k, v over heads before the kernel and of the output after it
  (forward), the same four backward; needs the head counts divisible by N.
- ring: per step, N - 1 exchanges of the key/value block with the neighbours (forward), N - 1 of keys,
  values and their gradients (backward). Its point is overlapping each exchange with a block of
  compute, on CUDA streams; that overlap is not measured here, only the traffic.

Each pattern's collectives run for real between --ranks gloo processes on this machine with tensors of
the given shapes (--tokens is the whole row; the gather patterns through ContextShard's own calls). The
table gives the bytes one rank sends, the median seconds over --repeats, and the ratio

    pattern seconds / gather seconds   (> 1: spec_cli's gather moves the keys faster)

followed by the bytes per rank for Llama-3.1-8B's draft (32 heads, 8 KV heads of 128, TTT 7) at 32k and
128k for N = 2, 4, 8 (the same formulas). Gloo on loopback says how the volumes and collective counts
compare, not what NVLink or InfiniBand take.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PATTERNS = ("gather", "gather-each-step", "ulysses", "ring")


def sent_bytes(
    pattern: str, tokens: int, ranks: int, heads: int, kv: int, dim: int, width: int, steps: int
) -> int:
    """Bytes one rank sends per layer and batch (an unroll of `steps` TTT steps, forward + backward)
    under `pattern`. Gradients of keys and values that add up over ranks travel in fp32 (4 bytes), as
    spec_cli accumulates them; all-gathers and reduce-scatters send N - 1 blocks per rank."""
    local = tokens // ranks
    kv_block = 2 * local * kv * dim  # this rank's keys and values (elements)
    if pattern == "gather":  # once per unroll: the keys gathered, their gradients reduce-scattered
        return (ranks - 1) * kv_block * (width + 4)
    if (
        pattern == "gather-each-step"
    ):  # per step: gathered forward and again backward, then scattered
        return steps * (ranks - 1) * kv_block * (2 * width + 4)
    if pattern == "ulysses":  # per step: q, k, v in and o out, forward; their gradients backward
        return (
            steps
            * 2
            * (2 * local * heads * dim + 2 * local * kv * dim)
            * width
            * (ranks - 1)
            // ranks
        )
    if (
        pattern == "ring"
    ):  # per step: N - 1 hops of k, v forward; of k, v and their fp32 gradients backward
        return steps * (ranks - 1) * kv_block * (2 * width + 4)
    raise ValueError(pattern)


def _patterns(rank: int, size: int, args) -> dict[str, float]:
    from spec_cli.draft.context import ContextShard

    torch.manual_seed(rank)
    dtype = DTYPES[args.dtype]
    local = args.tokens // size
    shard = ContextShard(size, rank, args.tokens)
    q = torch.randn(1, args.heads, local, args.head_dim).to(dtype)
    k = torch.randn(1, args.kv_heads, local, args.head_dim).to(dtype)
    v = torch.randn(1, args.kv_heads, local, args.head_dim).to(dtype)
    whole = torch.randn(
        1, args.kv_heads, args.tokens, args.head_dim
    )  # a whole row's fp32 gradients

    def gather() -> (
        None
    ):  # spec_cli: the same calls its ContextBias.whole_rows makes, once per unroll
        shard.gather(k, 2), shard.gather(v, 2)
        shard.scatter_sum(whole, 2), shard.scatter_sum(whole, 2)

    def gather_each_step() -> None:  # the form before: per step, forward and backward
        for _ in range(args.ttt_steps):
            shard.gather(k, 2), shard.gather(v, 2)
            shard.gather(k, 2), shard.gather(v, 2)
            shard.scatter_sum(whole, 2), shard.scatter_sum(whole, 2)

    def heads_to_rows(t: torch.Tensor) -> torch.Tensor:  # [1, h, local, d] -> [1, h / N, T, d]
        send = t.unflatten(1, (size, -1)).movedim(1, 0).contiguous()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send)
        return got.movedim(0, 2).flatten(2, 3)

    def rows_to_heads(t: torch.Tensor) -> torch.Tensor:  # [1, h / N, T, d] -> [1, h, local, d]
        send = t.unflatten(2, (size, -1)).movedim(2, 0).contiguous()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send)
        return got.movedim(0, 1).flatten(1, 2)

    def ulysses() -> None:
        for _ in range(
            2 * args.ttt_steps
        ):  # forward; backward moves the same shapes (the gradients)
            qh, _, _ = heads_to_rows(q), heads_to_rows(k), heads_to_rows(v)
            rows_to_heads(qh)  # the output (as many heads as q)

    def ring() -> None:
        block = torch.stack([k, v]).contiguous()
        grads = torch.zeros(block.shape, dtype=torch.float32)
        for _ in range(args.ttt_steps):
            for payloads in ([block], [block, grads]):  # forward, backward
                for _ in range(size - 1):
                    incoming = [torch.empty_like(p) for p in payloads]
                    ops = [
                        op
                        for p, i in zip(payloads, incoming)
                        for op in (
                            dist.P2POp(dist.isend, p, (rank + 1) % size),
                            dist.P2POp(dist.irecv, i, (rank - 1) % size),
                        )
                    ]
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
                    payloads = incoming

    runs = {
        "gather": gather,
        "gather-each-step": gather_each_step,
        "ulysses": ulysses,
        "ring": ring,
    }
    seconds = {name: [] for name in PATTERNS}
    for repeat in range(args.repeats + 1):
        for name in PATTERNS:  # alternating, so drift hits every pattern alike
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            dist.barrier()
            if repeat:  # the first round warms the connections
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        result = _patterns(rank, size, args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="slots of the whole row")
    parser.add_argument(
        "--ranks", type=int, default=2, help="the context-parallel group (gloo processes)"
    )
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    if args.tokens % (2 * args.ranks) or args.heads % args.ranks or args.kv_heads % args.ranks:
        parser.error(
            "--tokens must be divisible by 2 x --ranks (zig-zag chunks), --heads and --kv-heads by "
            "--ranks (Ulysses splits heads)"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(
        _worker, args=(args.ranks, port, args, queue), nprocs=args.ranks, start_method="spawn"
    )
    seconds = queue.get(timeout=5)
    width = DTYPES[args.dtype].itemsize
    shape = (
        args.tokens,
        args.ranks,
        args.heads,
        args.kv_heads,
        args.head_dim,
        width,
        args.ttt_steps,
    )
    print(
        f"{args.ranks} gloo ranks on this machine, a row of {args.tokens} slots, {args.heads} heads / "
        f"{args.kv_heads} KV heads of {args.head_dim}, {args.dtype}, {args.ttt_steps} TTT steps; per layer "
        "and batch, forward + backward\n"
    )
    print("| pattern | MiB sent per rank | seconds (median) | / gather |")
    print("|---|---|---|---|")
    for name in PATTERNS:
        print(
            f"| {name} | {sent_bytes(name, *shape) / 2**20:.1f} | {seconds[name]:.4f} | "
            f"{seconds[name] / seconds['gather']:.2f} |"
        )
    print(
        "\nLlama-3.1-8B's draft (32 heads, 8 KV heads of 128, bf16, TTT 7), MiB sent per rank per layer and "
        "batch, forward + backward:\n"
    )
    print("| row | N | " + " | ".join(PATTERNS) + " |")
    print("|---|---|" + "---|" * len(PATTERNS))
    for tokens in (32768, 131072):
        for n in (2, 4, 8):
            row = [sent_bytes(p, tokens, n, 32, 8, 128, 2, 7) / 2**20 for p in PATTERNS]
            print(f"| {tokens // 1024}k | {n} | " + " | ".join(f"{x:,.0f}" for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
