"""A fake target backend for stream tests: deterministic batches from the inputs, no model."""

from __future__ import annotations

import threading
import time

import torch

from spec_cli.batch import TargetBatch
from spec_cli.targets.backend import TargetBackend


class FakeBackend(TargetBackend):
    """Supervision that is a pure function of the inputs. `delay` seconds per call; `fail_at`: the
    call whose input_ids[0, 0] equals it raises RuntimeError."""

    def __init__(
        self, hidden: int = 8, vocab: int = 16, delay: float = 0.0, fail_at: int | None = None
    ):
        self.hidden, self.vocab, self.delay, self.fail_at = hidden, vocab, delay, fail_at
        self.info = {"target_fingerprint": "fake-target"}
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def generate_batch(
        self, input_ids, attention_mask, loss_mask, position_ids=None, seq_lens=None
    ):
        first = int(input_ids[0, 0])
        with self._lock:
            self.calls.append(first)
        if self.delay:
            time.sleep(self.delay)
        if first == self.fail_at:
            raise RuntimeError(f"target failed on batch {first}")
        B, T = input_ids.shape
        gen = torch.Generator().manual_seed(first)
        return TargetBatch(
            aux_hidden=torch.randn(B, T, 3 * self.hidden, generator=gen).to(torch.bfloat16),
            input_ids=input_ids.clone(),
            attention_mask=attention_mask.clone(),
            loss_mask=loss_mask.clone(),
            target_p=torch.softmax(torch.randn(B, T, self.vocab, generator=gen), dim=-1),
            position_mask=loss_mask.bool(),
            target_ids=input_ids % self.vocab,
            target_mass=torch.rand(B, T, generator=gen),
            position_ids=position_ids,
            seq_lens=seq_lens,
        )


def inputs(i: int, B: int = 2, T: int = 12) -> dict:
    """generate_batch keyword arguments for batch number i (input_ids[0, 0] == i)."""
    ids = torch.arange(B * T).view(B, T) + i
    ids[0, 0] = i
    am = torch.ones(B, T, dtype=torch.long)
    am[-1, T - 3 :] = 0
    return {"input_ids": ids, "attention_mask": am, "loss_mask": am.clone()}


def assert_same_batch(got: TargetBatch, want: TargetBatch) -> None:
    got_t, want_t = got.tensors(), want.tensors()
    assert set(got_t) == set(want_t)
    for name, t in want_t.items():
        assert got_t[name].dtype == t.dtype and torch.equal(got_t[name], t), name
