"""Host syncs of one training step counted by CUDA itself (a GPU is needed; the CPU count is
tests/draft/test_host_syncs.py's).

    python bench/cuda_syncs.py

Runs the tests' tiny EAGLE-3 draft's whole step (TTT forward, backward, gradient clipping, AdamW) on
CUDA under `torch.cuda.set_sync_debug_mode("warn")`, which warns at every operation that makes the host
wait for the GPU, and prints the warnings per step for TTT depths 1/3/7, 1/4/8 documents per row and
activation checkpointing off/on, then EAGLE-1/2's step. The CPU emulation says 1 per step for each
(the one `.tolist()` of the index sets' sizes); this is where that is checked against the driver.
Exits 1 if any step differs from 1.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def count(draft, forward, batch, steps: int = 2, where: bool = False) -> list[int]:
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def step():
        forward(draft, batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # makes the optimizer's state
    torch.cuda.synchronize()
    out = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        out.append(sum("synchroniz" in str(w.message) for w in seen))
    if where:  # the line of spec_cli (or the test helper) each of the last step's syncs came from
        for w in seen:
            print(f"  sync at {w.filename}:{w.lineno}: {str(w.message)[:80]}")
    return out


def main(argv: list[str] | None = None) -> int:
    where = "--where" in (sys.argv[1:] if argv is None else argv)
    from spec_cli.draft.eagle.objective import eagle_forward
    from spec_cli.draft.eagle3.ttt import ttt_forward
    from tests.draft import random_batch, tiny_draft
    from tests.draft.eagle.test_model import eagle_draft
    from tests.draft.eagle.test_objective import batch_of

    if not torch.cuda.is_available():
        print("bench/cuda_syncs.py needs a GPU (the CPU count is tests/draft/test_host_syncs.py)")
        return 0
    cuda = torch.device("cuda")
    rows, bad = [], 0
    T = 48
    for ckpt in (False, True):
        for docs in (1, 4, 8):
            for depth in (1, 3, 7):
                draft = tiny_draft().to(cuda)
                seq_lens = None if docs == 1 else [[T // docs] * docs, [T // docs] * (docs - 1)]
                batch = random_batch(draft.config, [T, T - 5], T, seq_lens).to(cuda)
                n = count(
                    draft,
                    lambda d, b: ttt_forward(d, b, ttt_steps=depth, checkpoint=ckpt),
                    batch,
                    where=where and depth == 3 and docs == 4 and not ckpt,
                )
                rows.append(
                    {
                        "algorithm": "eagle3",
                        "ttt": depth,
                        "docs": docs,
                        "checkpointing": ckpt,
                        "syncs": n,
                    }
                )
                bad += any(x != 1 for x in n)
    for depth in (1, 4):
        draft = eagle_draft().to(cuda)
        n = count(
            draft,
            lambda d, b: eagle_forward(d, b, ttt_steps=depth),
            batch_of([20, 13], 20).to(cuda),
            where=where and depth == 4,
        )
        rows.append({"algorithm": "eagle", "ttt": depth, "syncs": n})
        bad += any(x != 1 for x in n)
    for row in rows:
        print(json.dumps(row))
    print(f"cuda_syncs: {len(rows) - bad} of {len(rows)} steps made exactly one host sync")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
