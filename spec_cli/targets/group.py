"""A live or served target under --context-parallel: asked once per group, each rank handed only its
slots.

The group's first rank loads the target (or, with --remote, asks the servers) for the group's whole
rows (as one process would: the rows at their own length, then padded to the group's chunks); it keeps
its own slots of the supervision and sends every other rank of the group its slots
(spec_cli/draft/context.py kept_ranges: its two chunks and the TTT depth it reads ahead), point to point
over the group. The other ranks hold none of the target: its weights, its forward and the whole rows'
supervision (target_p over the draft vocab, the aux states) live on the first rank only. What every
rank needs of the target besides (its facts, the input embeddings, the output head) is broadcast once.

Every rank calls the same methods in the same order (the trainer's loop asks for each batch on its
main thread, on every rank alike), so the transfers match on NCCL as on gloo: this is why `--stream`
(producer threads at each rank's own pace) is refused with it. Tensors travel on the rank's device
(GPU to GPU over NCCL; host memory over gloo); nothing is pickled: a transfer's header (names, dtypes,
shapes) is JSON in a uint8 tensor.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from spec_cli.batch import TargetBatch, parse_tensor_header, tensor_header
from spec_cli.data.vlm import TOKEN_TYPE_KEYS
from spec_cli.draft.context import kept_ranges, pad_rows
from spec_cli.targets.backend import TargetBackend

WHOLE = (
    "attention_mask",
    "position_ids",
    "seq_lens",
)  # fields that stay whole rows in a slot batch


def take_slots(batch: TargetBatch, ranges: list[tuple[int, int]]) -> TargetBatch:
    """The batch's slots `ranges` (back to back), as a feature cache reads them for one rank: every
    per-slot field cut to them, attention_mask / position_ids / seq_lens whole, `slots` their indices."""
    index = torch.cat([torch.arange(a, b) for a, b in ranges]).to(batch.input_ids.device)
    fields = {
        name: t if name in WHOLE else t[:, index]
        for name, t in batch.tensors().items()
        if name != "slots"
    }
    return TargetBatch.from_tensors({**fields, "slots": index})


class GroupTarget(TargetBackend):
    """The target of a context-parallel group: `backend` on the group's first rank (None elsewhere)."""

    reads_slots = True  # generate_batch(slots=...): the trainer asks for this rank's slots only
    in_step = (
        True  # every rank asks for each batch on its main thread, in the same order (no read-ahead)
    )

    def __init__(
        self, backend: TargetBackend | None, group, rank: int, size: int, device: torch.device
    ):
        self.backend, self.group, self.rank, self.size = backend, group, rank, size
        self.device = torch.device(device)
        self.leader = dist.get_global_rank(group, 0)
        self.halo = 0  # the TTT depth each rank reads ahead of its chunks (set by the trainer)
        self.keep_final_hidden, self.extra_fields = False, {}
        self.info = self._json(backend.info if rank == 0 else None)
        # image-text rows: the first rank's target runs its vision part over the whole rows
        self.reads_images = bool(
            self._json(getattr(backend, "reads_images", False) if rank == 0 else None)
        )
        self._embeddings: torch.Tensor | None = None

    # ------------------------------------------------------------------ collectives over the group
    def _json(self, obj) -> object:
        """`obj` of the first rank, on every rank (JSON in a uint8 tensor, its length first)."""
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(length, self.leader, group=self.group)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if self.rank == 0
            else torch.empty(int(length), dtype=torch.uint8, device=self.device)
        )
        if int(length):
            dist.broadcast(buffer, self.leader, group=self.group)
        return json.loads(bytes(buffer.cpu().numpy()).decode())

    def _tensors(self, tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The first rank's `tensors` (or None) on every rank: their header, then each broadcast."""
        specs = self._json(None if tensors is None else tensor_header(tensors))
        if specs is None:
            return None
        out = {}
        for name, dtype, shape in parse_tensor_header(specs):
            t = (
                tensors[name].to(self.device).contiguous()
                if self.rank == 0
                else torch.empty(shape, dtype=dtype, device=self.device)
            )
            dist.broadcast(t, self.leader, group=self.group)
            out[name] = t
        return out

    def _send(self, tensors: dict[str, torch.Tensor], rank: int) -> None:
        dst = dist.get_global_rank(self.group, rank)
        data = json.dumps(tensor_header(tensors)).encode()
        dist.send(
            torch.tensor([len(data)], dtype=torch.int64, device=self.device), dst, group=self.group
        )
        dist.send(
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device),
            dst,
            group=self.group,
        )
        for (
            t
        ) in tensors.values():  # on this rank's device: the receiver waits on that device's backend
            dist.send(t.to(self.device).contiguous(), dst, group=self.group)

    def _recv(self) -> dict[str, torch.Tensor]:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(length, self.leader, group=self.group)
        data = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        dist.recv(data, self.leader, group=self.group)
        out = {}
        for name, dtype, shape in parse_tensor_header(
            json.loads(bytes(data.cpu().numpy()).decode())
        ):
            out[name] = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(out[name], self.leader, group=self.group)
        return out

    # ------------------------------------------------------------------ the backend interface
    def get_input_embeddings(self) -> torch.Tensor:
        if self._embeddings is None:
            mine = {"weight": self.backend.get_input_embeddings()} if self.rank == 0 else None
            self._embeddings = self._tensors(mine)["weight"]
        return self._embeddings

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        if self.rank == 0:
            self.backend.set_vocab_mapping(selected_token_ids)

    def get_output_head(self) -> dict[str, torch.Tensor] | None:
        return self._tensors(self.backend.get_output_head() if self.rank == 0 else None)

    def generate_batch(
        self,
        input_ids,
        attention_mask,
        loss_mask,
        position_ids=None,
        seq_lens=None,
        slots=None,
        images=None,
    ) -> TargetBatch:
        """This rank's slots of the batch's rows (`slots`: its kept_ranges of rows padded to the group's
        chunks, as inputs_for gives them); the first rank runs the target over the whole rows (`images`:
        their image inputs, data/vlm.py; per-token types cut to the rows' length with the tokens)."""
        if slots is None:
            raise ValueError(
                "a context-parallel target hands out slots: pass this rank's (inputs_for)"
            )
        if self.rank != 0:
            return TargetBatch.from_tensors(self._recv())
        T = input_ids.shape[1]
        real = int(attention_mask.sum(1).max()) if seq_lens is None else int(seq_lens.sum(1).max())
        cut = lambda t: None if t is None else t[:, :real]  # the rows as one process collates them
        self.backend.keep_final_hidden, self.backend.extra_fields = (
            self.keep_final_hidden,
            self.extra_fields,
        )
        extra = (
            {}
            if images is None
            else {
                "images": {
                    name: cut(value) if name in TOKEN_TYPE_KEYS else value
                    for name, value in images.items()
                }
            }
        )
        whole = self.backend.generate_batch(
            cut(input_ids),
            cut(attention_mask),
            cut(loss_mask),
            cut(position_ids),
            seq_lens,
            **extra,
        )
        whole = pad_rows(whole, T)
        for rank in range(1, self.size):
            self._send(
                take_slots(whole, kept_ranges(self.size, rank, T, self.halo)).tensors(), rank
            )
        return take_slots(whole, [(int(a), int(b)) for a, b in slots])

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
