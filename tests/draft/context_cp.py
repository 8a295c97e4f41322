"""Run by tests/draft/test_context.py's torchrun launch (two ranks, gloo): the TTT objective under context
parallelism (each rank half of every row: zig-zag chunks 0+3 and 1+2) against the same objective run
whole in the same process, on the same batch and weights; then P-EAGLE's (COD-sampled from the same
seed, its rows padded to the group's chunks where they do not divide). The loss and per-step losses are the group's
sum of the ranks' shares, the metrics the sum of their counts, every gradient the sum over the ranks (as
DDP's all-reduce makes it, before its division by the world size). Rank 0 writes, per case, the largest
difference of each to OUT/context.json.

    ["-m", "tests.draft.context_cp", OUT] in tests/launch.py's job list
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spec_cli import distributed
from spec_cli.draft.context import Context, ContextShard
from spec_cli.draft.eagle.objective import eagle_forward
from spec_cli.draft.eagle3.ttt import ttt_forward
from tests.draft import random_batch, tiny_draft
from tests.draft.eagle.test_model import eagle_draft
from tests.draft.eagle.test_objective import batch_of
from tests.draft.peagle.test_objective import peagle_draft

T = 24
CASES = {  # name: (draft options, batch (lengths, packed documents), objective options)
    "rows": ({}, ([24, 17], None), dict(ttt_steps=3)),
    "packed": ({}, ([24, 24], [[7, 9, 8], [5, 19]]), dict(ttt_steps=4)),
    "packed-2-layers-checkpointed": (
        dict(num_hidden_layers=2),
        ([24, 24], [[11, 13], [24]]),
        dict(ttt_steps=3, checkpoint=True),
    ),
    "window": (dict(sliding_window=5), ([24, 21], None), dict(ttt_steps=3)),
    "window-packed": (dict(sliding_window=4), ([24, 24], [[10, 14], [3, 21]]), dict(ttt_steps=2)),
    "lk-alpha": ({}, ([24, 20], None), dict(ttt_steps=3, loss="lk-alpha")),
    "lk-lambda": (
        {},
        ([24, 24], [[7, 9, 8], [24]]),
        dict(ttt_steps=3, loss="lk-lambda", lk_kl_decay=3.0),
    ),
}

PEAGLE = {  # name: (draft options, (lengths, packed documents, row width), objective options, training)
    "rows": ({}, ([24, 17], None, 24), dict(ttt_steps=4), True),
    "rows-padded": ({}, ([22, 15], None, 22), dict(ttt_steps=3), True),  # 22 slots: padded to 24
    "packed-2-layers-checkpointed": (
        dict(num_hidden_layers=2),
        ([24, 24], [[7, 9, 8], [5, 19]], 24),
        dict(ttt_steps=4),
        True,
    ),
    "lk-alpha": ({}, ([24, 20], None, 24), dict(ttt_steps=3, loss="lk-alpha"), True),
    "eval": ({}, ([24, 24], [[11, 13], [24]], 24), dict(ttt_steps=4), False),  # every valid element
}


def _peagle(rank: int) -> dict:
    """P-EAGLE's objective with a Context of 2 (the objective pads, samples the whole rows and takes its
    anchors) against the whole rows in one process, from the same seed."""
    from spec_cli.draft.peagle.objective import PEagleObjective
    from spec_cli.train_options import ObjectiveOptions

    results = {}
    for name, (options, (lengths, docs, width), objective, training) in PEAGLE.items():
        drafts = [peagle_draft(**options).double() for _ in range(2)]
        checkpoint = "checkpointed" in name
        whole, parts = (
            PEagleObjective(
                d, ObjectiveOptions(**objective), activation_checkpointing=checkpoint
            ).train(training)
            for d in drafts
        )
        parts.context = Context(2, rank)
        batch = random_batch(drafts[0].config, lengths, width, docs, seed=3, dtype=torch.float64)
        outs = []
        for objective_ in (whole, parts):
            torch.manual_seed(17)  # the COD seed each draws
            _counts()
            out = objective_(batch)
            out.loss.backward()
            outs.append(out)
        results[f"peagle-{name}"] = _compare(outs[0], outs[1], *drafts)
        results[f"peagle-{name}"].update(
            _counts(),
            layers=options.get("num_hidden_layers", 1),
            steps=objective["ttt_steps"],
            checkpoint=False,
            mask_gathers=1,
            sampled=training,
        )
    return results


def _compare(whole, parts, draft_whole, draft_cp) -> dict:
    def total(t):
        t = t.detach().clone().double()
        dist.all_reduce(t)
        return t

    diffs = {
        name: float((total(getattr(parts, name)) - getattr(whole, name).double()).abs().max())
        for name in ("loss", "step_loss", "correct", "total", "supervised")
    }
    grads = {}
    for (name, p), (_, q) in zip(draft_whole.named_parameters(), draft_cp.named_parameters()):
        if p.grad is None:
            continue
        grads[name] = float(
            (total(q.grad) - p.grad.double()).abs().max() / p.grad.abs().max().clamp_min(1e-30)
        )
    diffs["grad_rel"] = max(grads.values())
    diffs["loss_value"] = float(whole.loss)
    return diffs


COLLECTIVES = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}


def _count_collectives() -> None:
    """Count the key traffic's collectives (the all-gathers of keys and values, the reduce-scatters of
    their gradients) as spec_cli/draft/context.py calls them."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            COLLECTIVES[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


def _counts() -> dict:
    out = dict(COLLECTIVES)
    for name in COLLECTIVES:
        COLLECTIVES[name] = 0
    return out


def main(out: str) -> None:
    distributed.init(torch.device("cpu"))
    _count_collectives()
    rank = dist.get_rank()
    shard = ContextShard(size=2, rank=rank, length=T)
    results = {}
    for impl in ("fused", "math"):
        for name, (options, (lengths, docs), objective) in CASES.items():
            whole_draft = tiny_draft(dtype=torch.float64, **options)
            cp_draft = tiny_draft(dtype=torch.float64, **options)
            whole_draft.attn_impl = cp_draft.attn_impl = impl
            batch = random_batch(whole_draft.config, lengths, T, docs, dtype=torch.float64)
            whole = ttt_forward(whole_draft, batch, **objective)
            whole.loss.backward()
            _counts()
            parts = ttt_forward(cp_draft, batch, shard=shard, **objective)
            parts.loss.backward()
            results[f"eagle3-{name}-{impl}"] = _compare(whole, parts, whole_draft, cp_draft)
            results[f"eagle3-{name}-{impl}"].update(
                _counts(),
                layers=options.get("num_hidden_layers", 1),
                steps=objective["ttt_steps"],
                checkpoint=objective.get("checkpoint", False),
            )
    # EAGLE-1/2: the same unroll, its head reading the final hidden state one slot further on
    whole_draft, cp_draft = eagle_draft().double(), eagle_draft().double()
    batch = batch_of([24, 19], T).map(lambda t: t.double() if t.is_floating_point() else t)
    whole = eagle_forward(whole_draft, batch, ttt_steps=3)
    whole.loss.backward()
    _counts()
    parts = eagle_forward(cp_draft, batch, ttt_steps=3, shard=shard)
    parts.loss.backward()
    results["eagle"] = _compare(whole, parts, whole_draft, cp_draft)
    results["eagle"].update(_counts(), layers=1, steps=3, checkpoint=False)
    results.update(_peagle(rank))
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "context.json").write_text(json.dumps(results, indent=1))
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
