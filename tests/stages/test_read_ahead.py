"""Training from a feature cache reads the next batches in a thread while the step runs (_ReadAhead):
the same batches, read ahead, in pinned memory and copied without a host wait on CUDA (emulated here
with a recording batch), a read's error raised where the batch is asked for, nothing left running."""

import threading
import time

import pytest
import torch

from spec_cli.errors import ArtifactError
from spec_cli.trainer.sources import _ReadAhead


class Recorded:
    """A batch that records where it was pinned and how it was moved."""

    def __init__(self, i, log):
        self.i, self.log = i, log

    def pin_memory(self):
        self.log.append(("pin", self.i, threading.current_thread().name))
        return self

    def to(self, device, non_blocking=False):
        self.log.append(("to", self.i, str(device), non_blocking, threading.current_thread().name))
        return self


def reader(log, fail_at=None, delay=0.0):
    def read(i):
        time.sleep(delay)
        log.append(("read", i, threading.current_thread().name))
        if i == fail_at:
            raise ArtifactError(f"shard of batch {i} is damaged", "run spec precompute again")
        return Recorded(i, log)

    return read


def finisher(log):
    def finish(batch):
        log.append(("finish", batch.i, threading.current_thread().name))
        return batch

    return finish


def test_batches_come_in_order_read_ahead_by_one_thread():
    log = []
    loader = _ReadAhead(reader(log), finisher(log), torch.device("cpu"), start=3, end=8, depth=2)
    try:
        assert loader.get(3).i == 3
        time.sleep(0.2)  # the thread reads 4 and 5 while the step would run
        reads = [e[1] for e in log if e[0] == "read"]
        assert reads[:3] == [3, 4, 5]
        assert all(e[2].startswith("spec-cache-read") for e in log if e[0] == "read")
        assert [loader.get(i).i for i in (4, 5, 6, 7)] == [4, 5, 6, 7]
        assert sorted(e[1] for e in log if e[0] == "read") == [
            3,
            4,
            5,
            6,
            7,
        ]  # each once, none past the end
        assert not [e for e in log if e[0] == "pin"]  # on a CPU nothing is pinned
        assert all(e[3] is False for e in log if e[0] == "to")
    finally:
        loader.close()


def test_on_cuda_the_thread_pins_and_the_copy_does_not_wait():
    log = []
    loader = _ReadAhead(
        reader(log), finisher(log), torch.device("cuda", 0), start=0, end=3, depth=1
    )
    try:
        for i in range(3):
            loader.get(i)
    finally:
        loader.close()
    pins = [e for e in log if e[0] == "pin"]
    moves = [e for e in log if e[0] == "to"]
    assert [e[1] for e in pins] == [0, 1, 2] and all(
        e[2].startswith("spec-cache-read") for e in pins
    )
    assert moves == [("to", i, "cuda:0", True, threading.current_thread().name) for i in range(3)]
    # decoded on the device by the loop's thread, after the copy: the reading thread does host work only
    finishes = [e for e in log if e[0] == "finish"]
    assert finishes == [("finish", i, threading.current_thread().name) for i in range(3)]
    assert all(log.index(f) > log.index(m) for f, m in zip(finishes, moves))


def test_a_read_error_is_raised_where_the_batch_is_asked_for():
    log = []
    loader = _ReadAhead(
        reader(log, fail_at=2), finisher(log), torch.device("cpu"), start=0, end=5, depth=2
    )
    try:
        assert loader.get(0).i == 0 and loader.get(1).i == 1
        with pytest.raises(ArtifactError, match="shard of batch 2 is damaged"):
            loader.get(2)
    finally:
        loader.close()


def test_close_waits_for_the_read_in_flight():
    log = []
    loader = _ReadAhead(
        reader(log, delay=0.3), finisher(log), torch.device("cpu"), start=0, end=10, depth=3
    )
    loader.close()  # while batch 0 is being read
    assert [e[1] for e in log if e[0] == "read"] == [0]  # it finished; the rest were cancelled
    assert not any(t.name.startswith("spec-cache-read") for t in threading.enumerate())
