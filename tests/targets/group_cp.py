"""Run by tests/targets/test_group.py's torchrun launch (two ranks, gloo): a live target under
--context-parallel 2 (spec_cli/targets/group.py), loaded on rank 0 only. Each rank writes what it got
(the target's facts, embeddings, output head, and its slots of each case's batch) to OUT/rankR.*, for the
test to compare with the whole target run in one process.

    ["-m", "tests.targets.group_cp", TARGET, OUT] in tests/launch.py's job list
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from spec_cli import distributed
from spec_cli.draft.context import kept_ranges
from spec_cli.targets.group import GroupTarget
from spec_cli.targets.hf_backend import HFTargetBackend
from tests.targets.test_group import CASES, HALO, inputs, vocab


def main(target: str, out: str) -> None:
    distributed.init(torch.device("cpu"))
    rank, group = distributed.context_group(2)
    inner = HFTargetBackend(Path(target), None, device="cpu", dtype="fp32") if rank == 0 else None
    grouped = GroupTarget(inner, group, rank, 2, torch.device("cpu"))
    grouped.halo = HALO
    grouped.set_vocab_mapping(vocab())
    tensors = {
        "embeddings": grouped.get_input_embeddings(),
        **{f"head.{k}": v for k, v in grouped.get_output_head().items()},
    }
    for name, (final_hidden, packed) in CASES.items():
        grouped.keep_final_hidden = final_hidden
        kw = inputs(packed)
        T = kw["input_ids"].shape[1]
        batch = grouped.generate_batch(**kw, slots=kept_ranges(2, rank, T, HALO))
        tensors |= {f"{name}.{k}": v for k, v in batch.tensors().items()}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / f"rank{rank}.safetensors")
    )
    (folder / f"rank{rank}.json").write_text(
        json.dumps({"info": grouped.info, "loaded": inner is not None})
    )
    grouped.close()
    dist.barrier()


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:])
