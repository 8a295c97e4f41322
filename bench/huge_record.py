"""Peak memory of one pathological record (issue 51): a single 50 MB conversation with --max-length 256.

    python bench/huge_record.py [--mb 50] [--max-length 256] [--target PATH]

The target's tokenizer (default: the demo's SmolLM2, `spec assets`) encodes one record of one short
question and an answer of MB megabytes of chat-like text, in a fresh process per way, and prints each
process's peak resident memory and time:
- whole: the record tokenised whole, then truncated to --max-length (what spec_cli did before: the
  baseline);
- cut: spec_cli's encode_record, which cuts the record where its first --max-length tokens cannot
  change (spec_cli/data/template.py `bounded`); its ids and mask must equal the baseline's;
- build-vocab-map: `spec build-vocab-map --max-length L` over a data file of that record and 20 ordinary
  ones, end to end.
Prints the ratio whole / cut; exits 1 if the cut ids differ from the whole ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the model can write code and answer questions about data in a few lines , then it explains why "
    "each step matters : 1 2 3 ; training drafts for speculative decoding needs the target's answers"
).split()

CHILD = r"""
import json, resource, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from spec_cli.data.template import encode_chat, encode_record, special_token_strings
from spec_cli.targets.loading import load_tokenizer
tokenizer = load_tokenizer({target!r})
record = json.loads(open({record!r}).read())
specials = special_token_strings(tokenizer)
start = time.perf_counter()
if {way!r} == "whole":
    ids, mask = encode_chat(tokenizer, record["messages"], specials)
    ids, mask = ids[:{max_length}], mask[:{max_length}]
else:
    ids, mask = encode_record(tokenizer, record, {max_length}, specials)
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "ids": ids.tolist(), "mask": mask.tolist(),
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def huge_text(megabytes: float, seed: int = 0) -> str:
    rng = random.Random(seed)
    words, size = [], 0
    while size < megabytes * 1e6:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def child(way: str, target: str, record: Path, max_length: int) -> dict:
    code = CHILD.format(
        root=str(ROOT), target=target, record=str(record), way=way, max_length=max_length
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{way}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_vocab_map(target: str, data: Path, out: Path, max_length: int) -> dict:
    """`spec build-vocab-map` in a process of its own: its peak memory (this process's largest child's)."""
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spec_cli.cli",
            "build-vocab-map",
            "-t",
            target,
            "-d",
            str(data),
            "--draft-vocab-size",
            "4096",
            "--max-length",
            str(max_length),
            "-o",
            str(out),
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "SPEC_HOME": str(out.parent / "home")},
    )  # no tokenized cache
    if done.returncode:
        raise RuntimeError(f"build-vocab-map: {done.stderr[-2000:]}")
    return {
        "seconds": time.perf_counter() - start,
        "peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--target", default=None, help="a model folder (default: the demo's SmolLM2)")
    args = ap.parse_args(argv)
    if args.target is None:
        from spec_cli.assets import ensure_smollm2

        args.target = str(ensure_smollm2(install=False))
    with tempfile.TemporaryDirectory() as tmp:
        record = {
            "messages": [
                {"role": "user", "content": "Write a long story."},
                {"role": "assistant", "content": huge_text(args.mb)},
            ]
        }
        path = Path(tmp) / "huge.json"
        path.write_text(json.dumps(record))
        data = Path(tmp) / "data.jsonl"
        ordinary = [
            {
                "messages": [
                    {"role": "user", "content": huge_text(0.0005, i)},
                    {"role": "assistant", "content": huge_text(0.001, 100 + i)},
                ]
            }
            for i in range(20)
        ]
        data.write_text(
            "".join(json.dumps(r) + "\n" for r in [*ordinary[:10], record, *ordinary[10:]])
        )
        # first: RUSAGE_CHILDREN is the largest child's so far (the others report their own)
        vocab = build_vocab_map(args.target, data, Path(tmp) / "vm.safetensors", args.max_length)
        cut = child("cut", args.target, path, args.max_length)
        whole = child("whole", args.target, path, args.max_length)
        same = cut["ids"] == whole["ids"] and cut["mask"] == whole["mask"]
    print(f"one record of {args.mb:g} MB, --max-length {args.max_length}, tokenizer {args.target}")
    print(f"  whole (baseline): peak {whole['peak_mb']:8.0f} MB, {whole['seconds']:6.2f} s")
    print(
        f"  cut:              peak {cut['peak_mb']:8.0f} MB, {cut['seconds']:6.2f} s   "
        f"(whole / cut: {whole['peak_mb'] / cut['peak_mb']:.1f}x memory, "
        f"{whole['seconds'] / max(cut['seconds'], 1e-9):.0f}x time)"
    )
    print(
        f"  spec build-vocab-map over it and 20 ordinary records: peak {vocab['peak_mb']:.0f} MB, "
        f"{vocab['seconds']:.1f} s"
    )
    print(f"  the cut record's {len(cut['ids'])} ids and mask equal the whole one's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
