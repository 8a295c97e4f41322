"""Run by tests/test_distributed.py's torchrun launch (two ranks): --optimizer muon on a draft sharded as
`spec train --fsdp` shards it (spec_cli/draft/sharding.py) against the same draft whole, with the same
gradients. Newton-Schulz is patched to run in float64 here, so that any difference is in what each rank
computes (the whole matrix or only its rows), not in bf16 rounding; rank 0 writes the largest difference
per parameter to OUT/muon.json.

    ["-m", "tests.draft.muon_shards", OUT] in tests/launch.py's job list
"""

import json
import sys
from pathlib import Path

import torch
import torch.optim._muon as muon_impl

from spec_cli import distributed
from spec_cli.draft import sharding
from spec_cli.draft.optim import make_optimizer, ordered
from spec_cli.train_options import OptimOptions
from tests.draft import tiny_draft


def newton_schulz_fp64(grad, coefficients, steps, eps):
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.double().T if tall else grad.double()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def main(out: str) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    distributed.init(torch.device("cpu"))
    real = muon_impl._zeropower_via_newtonschulz
    muon_impl._zeropower_via_newtonschulz = (
        newton_schulz_fp64  # (the launch's next jobs get it back)
    )
    try:
        compare(out, DTensor, distribute_tensor)
    finally:
        muon_impl._zeropower_via_newtonschulz = real
        distributed.shutdown()


def compare(out: str, DTensor, distribute_tensor) -> None:
    options = OptimOptions(optimizer="muon", lr=3e-3, muon_lr=6e-3)
    results = []
    for sharded in (False, True):
        draft = tiny_draft(num_hidden_layers=2)
        if sharded:
            sharding.shard(draft, torch.device("cpu"))
        named = ordered([(n, p) for n, p in draft.named_parameters() if p.requires_grad], options)
        optimizer = make_optimizer([p for _, p in named], options, [n for n, _ in named])
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _, p in named:
                grad = torch.randn(p.shape, generator=gen)
                p.grad = (
                    distribute_tensor(grad, p.device_mesh, p.placements)
                    if isinstance(p, DTensor)
                    else grad
                )
            optimizer.step()
        results.append(
            {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in named}
        )
    if distributed.rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        moved = {
            n: (results[0][n] - tiny_draft(num_hidden_layers=2).state_dict()[n]).abs().max().item()
            for n in results[0]
        }
        diff = {n: (results[0][n] - results[1][n]).abs().max().item() for n in results[0]}
        (Path(out) / "muon.json").write_text(json.dumps({"diff": diff, "moved": moved}))


if __name__ == "__main__":
    main(*sys.argv[1:])
