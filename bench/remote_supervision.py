"""Supervision throughput from a `spec serve-target` server over loopback vs the in-process target.

    python bench/remote_supervision.py [--batches 4] [--batch-tokens 2048] [--max-length 512]
                                       [--prefetch 2] [--repeats 3] [--threads N] [--sequential]
                                       [--control]

Real SmolLM2-135M target (CPU, fp32), real ShareGPT conversations, a real 8192-token vocab map
(/work/demo/vocab-8192.safetensors when it matches the target, else one built here). The same
batches go through HFTargetBackend.generate_batch in this process and through RemoteBackend to a
server subprocess on 127.0.0.1 in the same run, fetched as `spec train --remote --prefetch N` fetches
them (N producer threads of spec_cli/stream ahead of the consumer, a memory store); every remote batch
is checked to be bit-identical to the in-process one. Each repeat times one in-process pass and one remote pass
back to back (order alternating: in/remote, remote/in, ...) and the figure is the median over
repeats of
    remote tokens/s (prefetch N) / in-process tokens/s      (goal: >= 0.9)
so a change in machine load between repeats does not bias it. `--sequential` adds the remote path
without prefetch (prefetch 0) to each repeat.

Client and server share this machine's cores: while the server runs the target, this process
receives and decodes the previous answer (the wire carries fp32 target_p [B, T, 8192], ~32 KiB per
token), which the in-process run never does. `--threads N` sets the intra-op threads of both
processes (default: torch's default, one per core). On a machine whose cores are also busy with other
work, a 2-thread OpenMP forward can run markedly slower on a process's main thread than on another
thread (the server answers on handler threads), which favours the remote path; `--threads 1` removes
that effect, and `--control` adds the in-process path run on a worker thread (as the server runs it),
so the remote path's own cost (wire, decode) can be read off against it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec_cli import assets  # noqa: E402
from spec_cli.artifacts.vocab_map import load_vocab_map  # noqa: E402
from spec_cli.data.batching import collate, plan_batches  # noqa: E402
from spec_cli.data.tokenize import tokenize_data  # noqa: E402
from spec_cli.serve.client import RemoteBackend  # noqa: E402
from spec_cli.stages import build_vocab_map  # noqa: E402
from spec_cli.stream import MemoryStore, Producer, StreamLoader, new_run_id  # noqa: E402
from spec_cli.targets import loading  # noqa: E402
from spec_cli.targets.hf_backend import HFTargetBackend  # noqa: E402

DEMO_VOCAB = Path("/work/demo/vocab-8192.safetensors")


def start_server(target: Path, token: str, threads: int = 0) -> tuple[subprocess.Popen, str]:
    code = (
        "import sys; from spec_cli.serve.run import serve; "
        "serve(sys.argv[1], port=0, device='cpu', dtype='fp32')"
    )
    env = {
        **os.environ,
        "SPEC_SERVE_TOKEN": token,
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "200",
        "PYTHONPATH": str(ROOT),
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(target)],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 300
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("the server did not start:\n" + "".join(seen))


def digest(batch) -> str:
    h = hashlib.sha256()
    for name, t in sorted(batch.tensors().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_local(backend, requests) -> tuple[float, list[str]]:
    start = time.perf_counter()
    out = [backend.generate_batch(*r) for r in requests]
    seconds = time.perf_counter() - start
    return seconds, [digest(b) for b in out]


def run_remote(remote: RemoteBackend, requests, prefetch: int) -> tuple[float, list[str]]:
    start = time.perf_counter()
    if prefetch == 0:
        out = [remote.generate_batch(*r) for r in requests]
    else:  # as `spec train --remote --prefetch N` does: N producer threads ahead, a memory store
        out = list(stream(remote, requests, prefetch))
    seconds = time.perf_counter() - start
    return seconds, [digest(b) for b in out]


def stream(remote: RemoteBackend, requests, prefetch: int) -> StreamLoader:
    keys = ("input_ids", "attention_mask", "loss_mask")
    producer = Producer(remote, MemoryStore(max_samples=prefetch + 1), new_run_id())
    return StreamLoader(
        producer,
        lambda i: dict(zip(keys, requests[i])),
        0,
        len(requests),
        prefetch=prefetch,
        workers=prefetch,
    )


def on_a_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequential", action="store_true", help="also time prefetch 0")
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per process (0: default)"
    )
    parser.add_argument(
        "--control", action="store_true", help="also time in-process on a worker thread"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = assets.ensure_smollm2()
    data = assets.ensure_sharegpt()
    tokenizer = loading.load_tokenizer(target)
    tok_fp = loading.tokenizer_fingerprint(tokenizer)
    work = Path(tempfile.mkdtemp(prefix="spec-bench-remote-"))

    # a modest slice of real conversations, batched exactly as `spec train` batches them
    subset = work / "sharegpt-subset.jsonl"
    with open(data, encoding="utf-8") as src:
        subset.write_text(
            "".join(line for _, line in zip(range(40 * args.batches), src)), encoding="utf-8"
        )
    tokens = tokenize_data(subset, tokenizer, tok_fp, args.max_length, use_cache=False)
    plan = plan_batches(tokens.lengths, args.batch_tokens)[: args.batches]
    requests = [collate(tokens, indices) for indices in plan]
    n_tokens = sum(int(am.sum()) for _, am, _ in requests)

    if (
        DEMO_VOCAB.is_file()
        and load_vocab_map(DEMO_VOCAB).metadata.get("tokenizer_fingerprint") == tok_fp
    ):
        vocab_path = DEMO_VOCAB
    else:
        vocab_path = work / "vocab-8192.safetensors"
        build_vocab_map.run(
            build_vocab_map.BuildVocabMapConfig(
                target=str(target),
                data=str(data),
                output=vocab_path,
                draft_vocab_size=8192,
                max_length=args.max_length,
            )
        )
    selected = load_vocab_map(vocab_path).selected_token_ids

    token = secrets.token_hex(16)
    proc, url = start_server(target, token, args.threads)
    try:
        local = HFTargetBackend(target, None, "cpu", "fp32")
        local.set_vocab_mapping(selected)
        remote = RemoteBackend([url], token=token)
        remote.set_vocab_mapping(selected)
        local.generate_batch(*requests[-1])  # warm-up, both sides
        remote.generate_batch(*requests[-1])
        _, want = run_local(local, requests)  # the reference digests (and a second warm-up)
        paths = {
            "in-process": lambda: run_local(local, requests),
            f"remote prefetch {args.prefetch}": lambda: run_remote(remote, requests, args.prefetch),
        }
        if args.sequential:
            paths["remote prefetch 0"] = lambda: run_remote(remote, requests, 0)
        if args.control:
            paths["in-process (thread)"] = lambda: on_a_thread(lambda: run_local(local, requests))
        rows = {key: [] for key in paths}
        for r in range(args.repeats):
            keys = list(paths) if r % 2 == 0 else list(reversed(paths))
            for key in keys:
                seconds, got = paths[key]()
                if got != want:
                    raise SystemExit(f"{key}: supervision differs from the in-process reference")
                rows[key].append(seconds)
            print(
                f"  repeat {r}: " + ", ".join(f"{k} {rows[k][-1]:.1f} s" for k in paths), flush=True
            )
        remote.close()
        local.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)

    answer_bytes = sum(
        b * t * (4 * selected.numel() + 4 * 3 * 576 + 8 * 4 + 4 + 1)
        for b, t in (r[0].shape for r in requests)
    )
    print(
        f"SmolLM2-135M fp32 on {torch.get_num_threads()} threads, {len(requests)} batches, "
        f"{n_tokens} tokens (B x T <= {args.batch_tokens}), draft vocab {selected.numel()}, "
        f"{answer_bytes / 2**20:.0f} MiB of answers per pass; all remote batches bit-identical"
    )
    result = {}
    for key, times in rows.items():  # per repeat: in-process seconds / this path's seconds
        ratio = statistics.median(a / b for a, b in zip(rows["in-process"], times))
        result[key] = {
            "tokens_per_s": round(n_tokens / statistics.median(times), 1),
            "ratio": round(ratio, 3),
            "seconds": [round(t, 2) for t in times],
        }
        print(
            f"  {key:20s} {result[key]['tokens_per_s']:8.1f} tokens/s   x{ratio:.3f} (median of "
            f"per-repeat ratios)   runs {result[key]['seconds']} s"
        )
    print(
        json.dumps(
            {
                "ratio_remote_over_in_process": result[f"remote prefetch {args.prefetch}"]["ratio"],
                "tokens": n_tokens,
                "batches": len(requests),
                **result,
            }
        )
    )


if __name__ == "__main__":
    main()
