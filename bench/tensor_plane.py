"""The served target's transport alone: a generate answer over the tensor plane vs in the HTTP body.

    python bench/tensor_plane.py [--tokens 2048] [--hidden 4096] [--aux 3] [--draft-vocab 32000]
                                 [--dtype bf16] [--repeats 5]

A `spec serve-target` server in a subprocess on 127.0.0.1 answers every generate with the same
precomputed batch, shaped as an 8B target's supervision for --tokens tokens (aux states [1, T, aux*H]
in --dtype, target_p [1, T, Vd] fp32, the per-token fields): no model runs, so the time is the
transport's. The same client fetches it over the tensor plane (gloo: JSON header over HTTP, tensors
by torch.distributed send/recv) and in the HTTP body (safetensors bytes), alternating per repeat; each
answer is checked bit-identical to the batch the server holds. Prints the median seconds per answer
and GB/s of each, and

    HTTP-body seconds / tensor-plane seconds   (> 1: the plane is faster)

Here both run over loopback on one machine, gloo on CPU tensors: the plane saves HTTP's framing and
the client's copies, not a device round trip. The case it exists for is GPU to GPU between hosts
(NCCL), where the tensors never touch host memory: that is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec_cli.batch import TargetBatch  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_batch(tokens: int, hidden: int, aux: int, vocab: int, dtype: torch.dtype) -> TargetBatch:
    gen = torch.Generator().manual_seed(0)
    T = tokens
    ids = torch.randint(0, 1000, (1, T), generator=gen)
    return TargetBatch(
        aux_hidden=torch.randn(1, T, aux * hidden, generator=gen).to(dtype),
        input_ids=ids,
        attention_mask=torch.ones(1, T, dtype=torch.long),
        loss_mask=torch.ones(1, T, dtype=torch.long),
        target_p=torch.rand(1, T, vocab, generator=gen),
        position_mask=torch.ones(1, T, dtype=torch.bool),
        target_ids=ids.clone(),
        target_mass=torch.rand(1, T, generator=gen),
    )


class FixedBackend:
    """A target backend that answers every request with one precomputed batch."""

    keep_final_hidden = False
    extra_fields: dict = {}

    def __init__(self, batch: TargetBatch, hidden: int, aux: int):
        self.batch = batch
        self.info = {
            "architecture": "bench",
            "vocab_size": 1 << 20,
            "hidden_size": hidden,
            "num_layers": 32,
            "aux_layers": list(range(aux)),
            "dtype": str(batch.aux_hidden.dtype).replace("torch.", ""),
            "target_fingerprint": "bench",
            "tokenizer_fingerprint": "bench",
        }

    def set_vocab_mapping(self, ids) -> None:
        pass

    def generate_batch(self, **_) -> TargetBatch:
        return self.batch

    def close(self) -> None:
        pass


def serve(args) -> None:
    from spec_cli.serve.http import HTTPHandle
    from spec_cli.serve.plane import PlaneHost
    from spec_cli.serve.server import Limits, TargetServer

    batch = make_batch(args.tokens, args.hidden, args.aux, args.draft_vocab, DTYPES[args.dtype])
    logic = TargetServer(
        FixedBackend(batch, args.hidden, args.aux),
        limits=Limits(max_batch_tokens=1 << 20, max_seq_len=1 << 20),
        plane=PlaneHost("127.0.0.1", 0, timeout=300),
    )
    handle = HTTPHandle(logic, "127.0.0.1", 0, request_timeout=300)
    print(f"listening on {handle.url}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    handle.stop(grace=5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--aux", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)

    from spec_cli.serve.client import RemoteBackend

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", *sys.argv[1:]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = server.stdout.readline()
    if not line.startswith("listening on "):
        raise SystemExit(f"the server did not start: {line!r}")
    url = line.split()[-1]
    want = make_batch(
        args.tokens, args.hidden, args.aux, args.draft_vocab, DTYPES[args.dtype]
    ).tensors()
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    T = args.tokens
    request = (
        torch.zeros(1, T, dtype=torch.long),
        torch.ones(1, T, dtype=torch.long),
        torch.ones(1, T, dtype=torch.long),
    )
    clients = {
        "tensor plane": RemoteBackend(url, timeout=300),
        "HTTP body": RemoteBackend(url, timeout=300, tensor_plane=False),
    }
    times = {key: [] for key in clients}
    try:
        assert "tensor plane (gloo" in clients["tensor plane"].transport, clients[
            "tensor plane"
        ].transport
        for client in clients.values():
            client.set_vocab_mapping(torch.arange(args.draft_vocab))
            client.generate_batch(*request)  # warm-up: connections, the channel
        for r in range(args.repeats):
            for key in list(clients) if r % 2 == 0 else list(reversed(clients)):
                start = time.perf_counter()
                got = clients[key].generate_batch(*request).tensors()
                times[key].append(time.perf_counter() - start)
                if set(got) != set(want) or not all(torch.equal(got[k], want[k]) for k in want):
                    raise SystemExit(f"{key}: the answer differs from the server's batch")
        assert clients["tensor plane"].received == {"plane": args.repeats + 1, "http": 0}
    finally:
        for client in clients.values():
            client.close()
        server.stdin.close()
        server.wait(timeout=60)
    print(
        f"one answer: {T} tokens, aux {args.aux} x {args.hidden} {args.dtype}, target_p {args.draft_vocab} "
        f"fp32: {nbytes / 2**20:.0f} MiB; loopback, gloo, {torch.get_num_threads()} threads; "
        f"every answer bit-identical"
    )
    result = {}
    for key, seconds in times.items():
        median = statistics.median(seconds)
        result[key] = {"seconds": round(median, 4), "GB_per_s": round(nbytes / median / 1e9, 2)}
        print(
            f"  {key:13s} {median * 1000:8.1f} ms per answer  {nbytes / median / 1e9:6.2f} GB/s   "
            f"runs {[round(s, 3) for s in seconds]}"
        )
    ratio = statistics.median(h / p for h, p in zip(times["HTTP body"], times["tensor plane"]))
    print(f"HTTP-body seconds / tensor-plane seconds: x{ratio:.2f} (median of per-repeat ratios)")
    print(json.dumps({"ratio_http_over_plane": round(ratio, 3), "answer_bytes": nbytes, **result}))


if __name__ == "__main__":
    main()
