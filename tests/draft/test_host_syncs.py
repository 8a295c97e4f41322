"""Host syncs in one training step's compute, counted on CPU by the ops that make the host wait for a
GPU (bench/host_syncs.py's CountSyncs: .item()/float()/bool() of a tensor, .tolist(), nonzero, boolean
indexing): the micro-batch's forward and backward, gradient clipping and the optimizer step, as
Trainer runs them. Each one drains the GPU's queue, so the count is held to one per micro-batch (the
index sets' sizes and the packed documents, fetched together), whatever the TTT depth, the documents
per row or activation checkpointing. The loop adds one more per optimizer step (the losses and token
count, spec_cli/trainer/loop.py). Host-to-device copies, which the op count cannot see on CPU, are
emulated by making the host the meta device (host_elsewhere). On an H200, `bench/cuda_syncs.py`
(CUDA's own sync check) counts the same steps."""

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from spec_cli.draft.eagle.objective import eagle_forward
from spec_cli.draft.eagle3.ttt import ttt_forward
from tests.draft import one_thread, random_batch, tiny_draft  # noqa: F401 (autouse fixture)
from tests.draft.eagle.test_model import eagle_draft
from tests.draft.eagle.test_objective import batch_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.host_syncs import CountSyncs  # noqa: E402


def host_elsewhere():
    """A context in which tensors made without a device are made on the meta device: the CPU stands for
    the GPU and meta for the host. On CUDA such a tensor is made on the host and then copied to the GPU
    (from pageable memory: a sync the CPU count cannot see); here that copy fails (meta has no data), and
    one made on the host and used with the draft's tensors fails too."""
    return torch.device("meta")


def step_syncs(draft, forward, batch, steps: int = 2):
    """The syncs of each of `steps` training steps (forward, backward, clip, AdamW) after a first one
    (which makes the optimizer's state), as counters."""
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def step(host=contextlib.nullcontext):
        with host():
            forward(draft, batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    counters = [s["step"] for s in optimizer.state.values()]  # on the CPU on CUDA too
    assert len(counters) == len(params)
    counts = []
    for _ in range(steps):
        with CountSyncs(host_tensors=counters) as mode:
            step(host_elsewhere)
        counts.append(mode.counts)
    return counts


@pytest.mark.parametrize("ttt_steps", [1, 3, 7])
@pytest.mark.parametrize("docs", [1, 4, 8])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_eagle3_step_syncs_once(ttt_steps, docs, checkpoint):
    T = 48
    draft = tiny_draft()
    seq_lens = None if docs == 1 else [[T // docs] * docs, [T // docs] * (docs - 1)]
    batch = random_batch(draft.config, [T, T - 5], T, seq_lens)
    for counts in step_syncs(
        draft, lambda d, b: ttt_forward(d, b, ttt_steps=ttt_steps, checkpoint=checkpoint), batch
    ):
        assert counts == {"tolist": 1}, dict(counts)


@pytest.mark.parametrize("docs,checkpoint", [(1, False), (4, True)])
def test_eagle3_windowed_step_syncs_once(docs, checkpoint):
    """--draft-window: the chunked kernel calls and their biases are planned from host ints (the
    documents already fetched) and made on the device: still one sync."""
    T = 48
    draft = tiny_draft(sliding_window=7)
    seq_lens = None if docs == 1 else [[T // docs] * docs, [T // docs] * (docs - 1)]
    batch = random_batch(draft.config, [T, T - 5], T, seq_lens)
    for counts in step_syncs(
        draft, lambda d, b: ttt_forward(d, b, ttt_steps=3, checkpoint=checkpoint), batch
    ):
        assert counts == {"tolist": 1}, dict(counts)


@pytest.mark.parametrize("ttt_steps", [1, 4])
def test_eagle_step_syncs_once(ttt_steps):
    draft = eagle_draft()
    batch = batch_of([20, 13], 20)
    for counts in step_syncs(draft, lambda d, b: eagle_forward(d, b, ttt_steps=ttt_steps), batch):
        assert counts == {"tolist": 1}, dict(counts)


def test_the_counter_sees_a_per_step_sync():
    """The counter is not blind: a nonzero per step (what the unroll did before) is counted."""
    with CountSyncs() as mode:
        masks = torch.rand(3, 2, 8) > 0.5
        for k in range(3):
            masks[k].nonzero(as_tuple=True)
        float(masks.sum())
    assert mode.counts == {"aten.nonzero": 3, "aten._local_scalar_dense": 1}


def test_the_emulation_sees_a_host_to_device_copy():
    """A tensor made on the host and copied to the device each step (rope's table did that: a sync per
    TTT step on CUDA, which the op count above cannot see) fails under host_elsewhere."""
    with host_elsewhere(), pytest.raises(NotImplementedError, match="meta"):
        torch.arange(4.0).to(torch.device("cpu"))


@pytest.mark.parametrize(
    "ttt_steps,segments,packed", [(4, 1, True), (7, 1, True), (4, 2, False), (7, 3, True)]
)
def test_peagle_batch_syncs_once(ttt_steps, segments, packed):
    """P-EAGLE: COD sampling, the segments' element sets, the supervised counts and the documents come
    to the host together, once per batch, whatever the depth and the number of segments (it was ~5 per
    depth and segment: a nonzero or int() for each set and count)."""
    from spec_cli.draft.peagle.objective import PEagleObjective
    from spec_cli.train_options import ObjectiveOptions
    from tests.draft.peagle.test_objective import packed_batch, peagle_draft

    draft = peagle_draft()
    batch = packed_batch(draft.config) if packed else random_batch(draft.config, [20, 17], 20)
    objective = PEagleObjective(
        draft, ObjectiveOptions(ttt_steps=ttt_steps, peagle_segments=segments)
    )
    params = [p for p in draft.parameters() if p.requires_grad]

    def step():
        for unit in objective.plan(
            batch
        ):  # as the trainer runs a batch: plan once, each unit's pass
            objective(batch, unit).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    step()  # the first keeps what it copies to the device once (rope's table)
    for _ in range(2):
        with CountSyncs() as mode, host_elsewhere():
            step()
        assert mode.counts == {"tolist": 1}, dict(mode.counts)


@pytest.mark.parametrize(
    "algorithm,size,packed,checkpoint,anchors",
    [
        ("dflash", 4, True, False, 0),
        ("dflash", 8, True, True, 0),
        ("dflash", 16, False, False, 0),
        ("dflash", 8, True, False, 5),
        ("dspark", 3, True, False, 0),
        ("dspark", 3, True, True, 5),
    ],
)
def test_block_drafter_batch_syncs_once(algorithm, size, packed, checkpoint, anchors):
    """DFlash and DSpark: every block offset's supervised slots, their counts and the documents come to the
    host together, once per batch, whatever the block size (the loss normaliser stays on the device);
    --max-anchors draws its anchors on the device from a host seed (no sync)."""
    from spec_cli.draft.dflash.objective import DFlashObjective
    from spec_cli.draft.dspark.objective import DSparkObjective
    from spec_cli.train_options import ObjectiveOptions
    from tests.draft.dflash.test_model import batch_for, dflash_draft
    from tests.draft.dspark.test_model import RANK, dspark_draft

    if algorithm == "dflash":
        draft = dflash_draft(size=size)
        options, make = ObjectiveOptions(block_size=size, max_anchors=anchors), DFlashObjective
    else:
        draft = dspark_draft(size=size)
        options = ObjectiveOptions(block_size=size, markov_rank=RANK, max_anchors=anchors)
        make = DSparkObjective
    batch = batch_for(draft, packed)
    objective = make(draft, options, activation_checkpointing=checkpoint)
    params = [p for p in draft.parameters() if p.requires_grad]

    def step():
        objective(batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    step()  # the first keeps what it copies to the device once (rope's table)
    for _ in range(2):
        with CountSyncs() as mode, host_elsewhere():
            step()
        assert mode.counts == {"tolist": 1}, dict(mode.counts)


def test_the_loops_stop_and_save_requests_ride_on_its_one_sync():
    """spec train's stop signal and timed save (spec_cli/trainer/loop.py `_asked`) are made, set and
    reduced over the ranks on the device without the host waiting: the step's sync count stays one."""
    from spec_cli.trainer.loop import _asked

    for stop, save in ((False, False), (True, False), (False, True), (True, True)):
        with CountSyncs() as mode:
            asked = _asked(stop, save, torch.device("cpu"))
        assert sum(mode.counts.values()) == 0, mode.counts
        assert asked.tolist() == [float(stop), float(save)]
