"""Run by tests/test_distributed.py's torchrun launch (two ranks): each rank supervises a
batch of its own (different lengths, one of them packed) with the target whole and with it sharded over
the two ranks (--target-parallel tensor), and writes the largest difference per tensor to OUT/rank-R.json.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.targets.tp_supervision TARGET OUT
    (or, in tests/launch.py's job list: ["-m", "tests.targets.tp_supervision", TARGET, OUT])
"""

import json
import sys
from pathlib import Path

import torch

from spec_cli import distributed
from spec_cli.targets import local


def batch(rank: int) -> dict:
    """Rank 0: two rows of 24 tokens, one padded; rank 1: one packed row of 31 tokens (3 documents)."""
    g = torch.Generator().manual_seed(rank)
    if rank == 0:
        ids = torch.randint(3, 200, (2, 24), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 18:] = 0
        return dict(input_ids=ids, attention_mask=mask, loss_mask=mask.clone())
    ids = torch.randint(3, 200, (1, 31), generator=g)
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=torch.ones_like(ids),
        seq_lens=torch.tensor([[10, 12, 9]]),
    )


def main(target: str, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    cpu = torch.device("cpu")
    distributed.init(cpu)
    rank = distributed.rank()
    selected = torch.arange(0, 256, 2)  # a draft vocabulary of 128 ids
    results = {}
    for parallel in ("replica", "tensor"):
        backend = local.open_backend(
            "transformers", Path(target), None, cpu, torch.float32, parallel=parallel
        )
        backend.set_vocab_mapping(selected)
        results[parallel] = (
            backend.generate_batch(**batch(rank)).tensors(),
            backend.group is not None,
        )
        backend.close()
    whole, sharded = results["replica"][0], results["tensor"][0]
    diffs = {k: float((whole[k].double() - sharded[k].double()).abs().max()) for k in whole}
    Path(out, f"rank-{rank}.json").write_text(
        json.dumps(
            {
                "sharded": results["tensor"][1],
                "replica_sharded": results["replica"][1],
                "diffs": diffs,
                "keys": sorted(whole) == sorted(sharded),
                "shape": list(whole["aux_hidden"].shape),
            }
        )
    )
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
