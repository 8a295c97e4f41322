"""The race's data, the same for every contestant (bench/race.py): one spec_cli feature cache read
through spec_cli's own cache reader, so each trainer gets the same token ids, loss masks, aux states
and target distributions over the same draft vocabulary.

A contestant asks for rows the way its own trainer forms them (`Feed(cache, rows=...)`):
- "packed": conversations packed into rows of up to `row_tokens` tokens, documents kept apart
  (`TargetBatch.seq_lens` / `position_ids`), as `spec train --pack` and speculators' trainer form
  them;
- "single": one conversation per row, cut at `row_tokens`, batch 1, as SpecForge's and NeMo
  AutoModel's EAGLE-3 defaults train.

Row i of the run is row `order_e[i mod n]` of epoch e = i // n, where `order_e` is a permutation
seeded by (seed, e): the data position is a function of the step alone, as in `spec train`.

What each field means (spec_cli/batch.py TargetBatch): `aux_hidden` [1, T, 3H] the target's aux
states in the draft's concatenation order, position-aligned; `input_ids` [1, T] shifted
(input_ids[t] is token t + 1); `loss_mask` [1, T] shifted the same way; `target_p` [1, T, Vd] the
target's distribution over the draft vocab at t (softmax of its logits); `position_mask` =
t2d[target argmax] & loss_mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.batch import TargetBatch
from spec_cli.data.batching import collate, collate_packed, plan_packed
from spec_cli.targets.cache_backend import CacheBackend


@dataclass
class Head:
    """What the cache keeps of the target besides its rows (float32, CPU)."""

    selected_token_ids: torch.Tensor  # [Vd] long, sorted: draft id -> target id
    t2d: torch.Tensor  # [V] bool: target ids in the draft vocab
    embed_tokens: torch.Tensor  # [V, H] the target's input embedding
    lm_head_selected: torch.Tensor | None  # [Vd, H] the target's lm_head rows of the draft vocab
    final_norm: torch.Tensor | None  # [H] the target's final RMSNorm weight

    @property
    def d2t(self) -> torch.Tensor:
        """[Vd] long: target id - draft id, the engines' offset table."""
        return self.selected_token_ids - torch.arange(self.selected_token_ids.numel())


class Feed:
    def __init__(self, cache: Path, rows: str = "packed", row_tokens: int = 8192, seed: int = 0):
        if rows not in ("packed", "single"):
            raise ValueError(f"rows {rows!r}: packed or single")
        self.backend = CacheBackend(Path(cache))
        self.rows, self.row_tokens, self.seed = rows, int(row_tokens), int(seed)
        self.tokens = self.backend.tokens()
        lengths = self.tokens.lengths
        if rows == "packed":
            self.plan = plan_packed(lengths, self.row_tokens)
        else:
            self.plan = [[i] for i in range(len(lengths))]
        m = self.backend.reader.manifest
        self.aux_layers: list[int] = list(m["aux_layers"])  # spec_cli's convention (docs/eagle.md)
        self.target: str = m["target"]  # the folder the cache was made from
        self.target_config: dict = m.get("target_config") or {}
        b = self.backend
        f32 = lambda t: None if t is None else t.detach().float().cpu()
        self.head = Head(
            b.selected.long().cpu(),
            b.t2d.bool().cpu(),
            f32(b.embed),
            f32(b.lm_head_selected),
            f32(b.final_norm),
        )

    def __len__(self) -> int:
        """Rows in one epoch."""
        return len(self.plan)

    def indices(self, i: int) -> list[int]:
        """The samples of the run's i-th row (0-based)."""
        epoch, pos = divmod(int(i), len(self.plan))
        order = torch.randperm(
            len(self.plan), generator=torch.Generator().manual_seed(self.seed + epoch)
        )
        return self.plan[int(order[pos])]

    def batch(self, i: int) -> TargetBatch:
        """The run's i-th row as a TargetBatch of one row (fp32 on the CPU)."""
        idx = self.indices(i)
        if self.rows == "packed":
            ids, am, lm, seq_lens = collate_packed(self.tokens, idx)
            inputs = dict(input_ids=ids, attention_mask=am, loss_mask=lm, seq_lens=seq_lens)
        else:
            ids, am, lm = collate(self.tokens, idx)
            inputs = dict(input_ids=ids, attention_mask=am, loss_mask=lm)
        batch = self.backend.generate_batch(**inputs)  # the cache finds its rows by their ids
        T = min(batch.input_ids.shape[1], self.row_tokens)  # "single": a longer chat is cut
        return batch.map(lambda t: (t.float() if t.is_floating_point() else t)[:, :T])

    def row_tokens_of(self, i: int) -> int:
        """Tokens of the run's i-th row (its real tokens, no padding): what "tokens seen" counts."""
        n = sum(int(self.tokens.lengths[j]) for j in self.indices(i))
        return min(n, self.row_tokens) if self.rows == "single" else n

    @property
    def epoch_tokens(self) -> int:
        return sum(self.row_tokens_of(i) for i in range(len(self.plan)))
