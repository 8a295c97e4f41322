"""On a GPU, `spec train` turns activation checkpointing on by itself when the run's largest batch would
not fit the GPU's free memory without it (spec plan's measure of the step): the choice against the
plan's own numbers, what it says, and the batch shape it plans for."""

import types

import torch

from spec_cli.draft import algorithms
from spec_cli.plan.auto import needs_checkpointing
from spec_cli.plan.report import FRAGMENTATION
from spec_cli.plan.step import measure_step
from spec_cli.train_options import ObjectiveOptions, OptimOptions
from spec_cli.trainer.device import largest_batch
from tests.draft import tiny_config


def cfg(pack=False, batch_tokens=512):
    return types.SimpleNamespace(
        objective=ObjectiveOptions(ttt_steps=2),
        optim=OptimOptions(),
        data=types.SimpleNamespace(pack=pack, batch_tokens=batch_tokens),
    )


def test_checkpointing_turns_on_only_when_the_step_would_not_fit(capsys):
    eagle3 = algorithms.get("eagle3")
    config = tiny_config()
    shape = (2, 256)
    peaks = {
        c: measure_step(
            eagle3, config, cfg().objective, 256, batch=2, activation_checkpointing=c
        ).peak
        * (1 + FRAGMENTATION)
        for c in (False, True)
    }
    assert peaks[True] < peaks[False]
    on_device = 1000
    assert not needs_checkpointing(
        eagle3, config, cfg(), shape, int(peaks[False]) - on_device + 1, on_device
    )
    assert capsys.readouterr().err == ""
    between = int((peaks[False] + peaks[True]) / 2)
    assert needs_checkpointing(eagle3, config, cfg(), shape, between, on_device)
    said = capsys.readouterr()
    assert "activation checkpointing on: the largest batch (2 x 256 tokens)" in said.out + said.err
    assert "expect an out-of-memory" not in said.out + said.err
    assert needs_checkpointing(eagle3, config, cfg(), shape, int(peaks[True] / 2), on_device)
    said = capsys.readouterr()
    assert "expect an out-of-memory error" in said.out + said.err


def test_no_plan_no_change():
    """P-EAGLE has no plan: the run keeps what was asked."""
    assert not needs_checkpointing(algorithms.get("peagle"), tiny_config(), cfg(), (1, 64), 0, 0)


def test_largest_batch_by_padded_tokens():
    lengths = torch.tensor([100, 30, 90, 50, 10])
    source = types.SimpleNamespace(
        tokens=types.SimpleNamespace(lengths=lengths), plan=[[0], [2, 3], [1, 4]]
    )
    assert largest_batch(source, cfg()) == (2, 90)  # 2 x 90 = 180 padded tokens beat 1 x 100
    assert largest_batch(source, cfg(pack=True)) == (1, 140)  # packed: the row's documents together
    assert largest_batch(types.SimpleNamespace(tokens=None, plan=[]), cfg(batch_tokens=4096)) == (
        1,
        4096,
    )


def test_an_fp32_run_is_planned_in_fp32():
    """--precision fp32 on a GPU: the step keeps fp32 activations, so the plan measures it in fp32
    (more memory than bf16's): free memory between the two turns checkpointing on for fp32 only."""
    eagle3 = algorithms.get("eagle3")
    config = tiny_config()
    peaks = {
        d: measure_step(eagle3, config, cfg().objective, 256, batch=2, autocast_dtype=d).peak
        * (1 + FRAGMENTATION)
        for d in (torch.bfloat16, None)
    }
    assert peaks[None] > peaks[torch.bfloat16]
    between = int((peaks[None] + peaks[torch.bfloat16]) / 2)
    assert not needs_checkpointing(eagle3, config, cfg(), (2, 256), between, 0, torch.bfloat16)
    assert needs_checkpointing(eagle3, config, cfg(), (2, 256), between, 0, None)
