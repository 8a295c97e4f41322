"""The trainer's side of streaming: producer threads run ahead, the loader hands back batches in order.

StreamLoader(producer, inputs, start, stop, prefetch) makes batch numbers start..stop-1:
- `workers` threads take the next number, build its inputs (`inputs(i)`: the keyword arguments of
  generate_batch) and run the target, never more than `prefetch` batches ahead of the one the
  trainer asks for;
- they put into the store in batch order (a thread done early waits for its turn), so the store
  only ever holds the batches the trainer wants next: a put waiting on the store's bounds can never
  block the batch the trainer waits for (no deadlock), and the bounds hold;
- get(i) waits for batch i's ref, reads the sample, releases it and returns the TargetBatch on
  `device`, bit for bit what the backend returned;
- an error in a producer is raised by get() for that batch (the batches before it still arrive);
- close() (end, error or Ctrl-C) stops the threads, evicts every sample not consumed and closes the
  store; it is safe to call twice.
The report says where the store's byte bound came from (`bound_source`: spec_cli/stream/bound.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import fields

import torch

from spec_cli.batch import EXTRA, TargetBatch
from spec_cli.stream.bound import size_text
from spec_cli.stream.producer import Producer, SampleRef
from spec_cli.stream.store import FeatureStore, StoreClosedError, StoreError

log = logging.getLogger(__name__)

BATCH_FIELDS = [f.name for f in fields(TargetBatch)]


def load(store: FeatureStore, ref: SampleRef, device: torch.device | str) -> TargetBatch:
    """The batch a ref names, on `device`; its sample is released from the store."""
    sample = store.get(ref.sample_id)
    meta, tensors = sample.metadata, sample.tensors
    shapes = {k: list(t.shape) for k, t in tensors.items()}
    if (
        meta.get("run_id") != ref.run_id
        or meta.get("index") != ref.index
        or shapes != ref.shapes
        or {k for k in tensors if not k.startswith(EXTRA)} - set(BATCH_FIELDS)
    ):
        raise StoreError(
            f"the stream sample {ref.sample_id!r} does not match its reference "
            f"(stored {meta.get('run_id')}/{meta.get('index')} {shapes}, ref "
            f"{ref.run_id}/{ref.index} {ref.shapes})",
            "give each producing run its own store (or run id)",
        )
    batch = TargetBatch.from_tensors(dict(tensors)).to(device)
    store.release(ref.sample_id)
    return batch


class StreamLoader:
    def __init__(
        self,
        producer: Producer,
        inputs: Callable[[int], dict],
        start: int,
        stop: int,
        prefetch: int = 2,
        workers: int = 1,
        device: torch.device | str = "cpu",
        join_s: float = 10.0,
        bound_source: str | None = None,
    ):
        self.producer, self.store = producer, producer.store
        self.bound_source = bound_source  # where the store's max_bytes came from (auto, given)
        self.inputs, self.stop_at, self.prefetch = inputs, stop, max(0, prefetch)
        self.device, self.join_s = device, join_s
        self._cond = threading.Condition()
        self._next = start  # the next batch number a producer takes
        self._turn = start  # the batch number whose put is next
        self._want = start  # the batch number the trainer asks for (or will ask for first)
        self._asked = False  # whether the trainer has asked for _want already
        self._refs: dict[int, SampleRef] = {}
        self._failed: tuple[int, BaseException] | None = None
        self._stopped = False
        self._stats = {
            "produced": 0,
            "consumed": 0,
            "discarded": 0,
            "trainer_wait_s": 0.0,
            "target_s": 0.0,
        }
        self._threads = [
            threading.Thread(target=self._work, name=f"spec-stream-{k}", daemon=True)
            for k in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ producer threads
    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopped
                        or self._failed is not None
                        or self._next >= self.stop_at
                        or self._next <= self._want + self.prefetch
                    )
                )
                if self._stopped or self._failed is not None or self._next >= self.stop_at:
                    return
                i, self._next = self._next, self._next + 1
            try:
                t0 = time.perf_counter()
                batch = self.producer.generate(**self.inputs(i))
                target_s = time.perf_counter() - t0
                with self._cond:  # puts in batch order
                    self._cond.wait_for(
                        lambda: (
                            self._turn == i
                            or self._stopped
                            or (self._failed is not None and self._failed[0] < i)
                        )
                    )
                    if self._turn != i:
                        return
                ref = self.producer.publish(i, batch)  # may wait on the store's bounds
                del batch
            except BaseException as exc:  # noqa: BLE001 (handed to the trainer's thread)
                with self._cond:
                    if not self._stopped and (self._failed is None or i < self._failed[0]):
                        self._failed = (i, exc)
                    self._cond.notify_all()
                return
            with self._cond:
                self._stats["target_s"] += target_s
                self._stats["produced"] += 1
                if self._stopped:
                    self.producer.discard(ref)
                    self._stats["discarded"] += 1
                else:
                    self._refs[i] = ref
                self._turn = i + 1
                self._cond.notify_all()

    # ------------------------------------------------------------------ the trainer's side
    def get(self, i: int) -> TargetBatch:
        """Batch number i (ask in order: start, start+1, ...)."""
        with self._cond:
            if self._stopped:
                raise StoreClosedError("the stream loader is closed", "this is a bug in the caller")
            expected = self._want + 1 if self._asked else self._want
            if i != expected or i >= self.stop_at:
                raise RuntimeError(
                    f"stream batches come in order, {expected} next (the last is "
                    f"{self.stop_at - 1}); asked for {i}"
                )
            self._want, self._asked = i, True
            self._cond.notify_all()
            t0 = time.perf_counter()
            self._cond.wait_for(
                lambda: (
                    i in self._refs
                    or self._stopped
                    or (self._failed is not None and self._failed[0] <= i)
                )
            )
            self._stats["trainer_wait_s"] += time.perf_counter() - t0
            ref = self._refs.pop(i, None)
            if ref is None:
                if self._stopped:
                    raise StoreClosedError(
                        "the stream loader was closed", "the run is shutting down"
                    )
                raise self._failed[1]
        batch = load(self.store, ref, self.device)
        with self._cond:
            self._stats["consumed"] += 1
        return batch

    def __iter__(self):
        with self._cond:
            start = self._want + 1 if self._asked else self._want
        for i in range(start, self.stop_at):
            yield self.get(i)

    def close(self) -> None:
        """Stop the producers, evict what was not consumed, close the store."""
        with self._cond:
            self._stopped = True
            refs, self._refs = list(self._refs.values()), {}
            self._cond.notify_all()
        for ref in refs:
            self.producer.discard(ref)
        with self._cond:
            self._stats["discarded"] += len(refs)
        self.store.close()  # wakes a put waiting on the bounds; frees anything put meanwhile
        deadline = time.monotonic() + self.join_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:  # a target call still running; it finds the store closed and drops its batch
            log.warning("stream producers still running at shutdown: %s", ", ".join(alive))

    def report(self) -> dict:
        """The store's health plus the pipeline's counts and waits."""
        with self._cond:
            stats = dict(self._stats)
        return {
            **self.store.health(),
            **stats,
            "workers": len(self._threads),
            "prefetch": self.prefetch,
            "max_bytes_source": self.bound_source,
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def report_rows(report: dict) -> list[tuple[str, str]]:
    """The summary lines of a StreamLoader report."""
    bound = "none" if report["max_bytes"] is None else size_text(report["max_bytes"])
    if report.get("max_bytes_source"):
        bound += f" ({report['max_bytes_source']})"
    return [
        (
            "stream store",
            f"{report['backend']}, peak {report['peak_bytes'] / 2**20:.1f} MiB of {bound}, "
            f"peak {report['peak_samples']} of {report['max_samples']} samples, "
            f"{report['samples']} left",
        ),
        (
            "stream batches",
            f"{report['produced']} produced, {report['consumed']} consumed, "
            f"{report['evicted']} evicted unused",
        ),
        (
            "stream waits",
            f"trainer waited {report['trainer_wait_s']:.1f} s for batches; producers "
            f"waited {report['put_wait_s']:.1f} s on the bound, ran the target "
            f"{report['target_s']:.1f} s",
        ),
    ]
