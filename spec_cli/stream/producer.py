"""The producer: run a target backend on a batch and put its supervision into a store.

What travels to the trainer is a SampleRef: a few ids and shapes, no tensors. The sample stays in the
store until the consumer releases it; a ref that will never reach the consumer must be discarded,
which evicts its sample (the loader does this for every ref it still holds at shutdown).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

from spec_cli.batch import TargetBatch
from spec_cli.stream.store import FeatureStore
from spec_cli.targets.backend import TargetBackend


@dataclass(frozen=True)
class SampleRef:
    run_id: str  # the producing run; sample ids are unique within it
    sample_id: str  # the store key
    index: int  # the batch number this sample supervises
    shapes: dict  # TargetBatch field -> shape (present fields only)
    dtypes: dict  # TargetBatch field -> dtype name
    nbytes: int  # what the sample holds in the store
    target_version: str  # the target's weights (its fingerprint)
    draft_version: (
        str  # the draft weights it was produced with ("0": supervision ignores the draft)
    )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SampleRef:
        return cls(**data)


def describe(batch: TargetBatch) -> tuple[dict, dict]:
    """(shapes, dtype names) of a batch's present fields."""
    tensors = batch.tensors()
    return (
        {k: list(t.shape) for k, t in tensors.items()},
        {k: str(t.dtype).replace("torch.", "") for k, t in tensors.items()},
    )


class Producer:
    """Runs `backend` and puts each batch's supervision into `store`.

    One thread at a time per Producer for a backend that is not thread-safe (wrap it in
    SerializedBackend); several producers, or threads over a thread-safe backend (remote), may share
    one store: the store serialises the puts.
    """

    def __init__(
        self,
        backend: TargetBackend,
        store: FeatureStore,
        run_id: str,
        target_version: str | None = None,
        draft_version: str = "0",
    ):
        self.backend, self.store, self.run_id = backend, store, run_id
        info = getattr(backend, "info", None) or {}
        self.target_version = target_version or str(info.get("target_fingerprint", ""))
        self.draft_version = draft_version

    def sample_id(self, index: int) -> str:
        return f"{self.run_id}-{index:09d}"

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        images: dict | None = None,
    ) -> TargetBatch:
        """`images`: an image-text batch's image inputs (data/vlm.py), for a backend that reads them."""
        more = {} if images is None else {"images": images}
        return self.backend.generate_batch(
            input_ids,
            attention_mask,
            loss_mask,
            position_ids=position_ids,
            seq_lens=seq_lens,
            **more,
        )

    def publish(
        self, index: int, batch: TargetBatch, block: bool = True, timeout: float | None = None
    ) -> SampleRef:
        """Put a generated batch into the store (waiting on its bounds) and return its ref."""
        shapes, dtypes = describe(batch)
        meta = {
            "run_id": self.run_id,
            "index": index,
            "shapes": shapes,
            "dtypes": dtypes,
            "target_version": self.target_version,
            "draft_version": self.draft_version,
        }
        sample_id = self.sample_id(index)
        nbytes = self.store.put(sample_id, batch.tensors(), meta, block=block, timeout=timeout)
        return SampleRef(
            self.run_id,
            sample_id,
            index,
            shapes,
            dtypes,
            nbytes,
            self.target_version,
            self.draft_version,
        )

    def produce(
        self,
        index: int,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        block: bool = True,
        timeout: float | None = None,
        images: dict | None = None,
    ) -> SampleRef:
        """Run the target on one batch and store its supervision."""
        batch = self.generate(input_ids, attention_mask, loss_mask, position_ids, seq_lens, images)
        return self.publish(index, batch, block, timeout)

    def discard(self, ref: SampleRef) -> None:
        """Evict the sample of a ref that will never be consumed."""
        self.store.evict(ref.sample_id)


class SerializedBackend(TargetBackend):
    """A backend that is not thread-safe (the in-process model: its hooks fill one shared dict),
    shared by producer threads and the trainer's evaluation: one call at a time."""

    def __init__(self, backend: TargetBackend):
        self.backend = backend
        self.info = backend.info
        self.reads_images = getattr(backend, "reads_images", False)
        self.lock = (
            threading.Lock()
        )  # held by every call; a caller of the backend's own methods takes it too

    def generate_batch(
        self, input_ids, attention_mask, loss_mask, position_ids=None, seq_lens=None, **slots
    ):
        """(`slots`: a cache's context-parallel ranges, passed on when given)"""
        with self.lock:
            return self.backend.generate_batch(
                input_ids,
                attention_mask,
                loss_mask,
                position_ids=position_ids,
                seq_lens=seq_lens,
                **slots,
            )

    def get_input_embeddings(self) -> torch.Tensor:
        with self.lock:
            return self.backend.get_input_embeddings()

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        with self.lock:
            self.backend.set_vocab_mapping(selected_token_ids)

    def close(self) -> None:
        with self.lock:  # after a batch in flight, never under it
            self.backend.close()
