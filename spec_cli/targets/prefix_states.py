"""The target's states kept by the token prefix that produced them, so that one engine pass can both
write an answer and supervise a draft on it (`spec regenerate --features`).

A causal decoder's state at position p depends on tokens 0..p only. So a state computed anywhere (a
prompt's prefill, one decode step of an answer, a later turn's prefill) is the state of every row whose
first p+1 tokens are the same. Each kept state is filed under a key of its prefix (a hash chain over
the token ids, `prefix_keys`), and a row is put together position by position from those keys.

This is also what makes vLLM's prefix caching safe here: the engine skips the forward over a block of
a prompt only when that block and everything before it are the same tokens as a block it computed
before, and that computation's states were kept under the same keys. A position that nothing computed
with the same prefix has no key: the row is then run again (`missing`), never filled with a state of
another prefix.
"""

from __future__ import annotations

import torch

_MASK = (1 << 63) - 1


def prefix_keys(tokens: list[int]) -> list[int]:
    """key[p] identifies tokens[0..p] (a 63-bit hash chain: hash((key[p-1], token p)))."""
    keys, key = [], 0x5BD1E995
    for t in tokens:
        key = hash((key, int(t))) & _MASK
        keys.append(key)
    return keys


class PrefixStates:
    """Final hidden [n, H] and aux [n, A] states by prefix key. `add` takes one engine step's states
    of one request (held until the request's tokens are known); `commit` files them under the keys of
    the request's tokens; `fill` puts a row together."""

    def __init__(self):
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._blocks: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # (hidden [n, H], aux [n, A]) on the CPU
        self._index: dict[int, tuple[int, int]] = {}  # prefix key -> (block, row in it)

    def __len__(self) -> int:
        return len(self._index)

    def add(
        self, request: str, positions: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor
    ) -> None:
        """One step's tokens of `request`: their positions [n], final hidden [n, H], aux [n, A]."""
        if positions.numel():
            # copies: on a CPU .cpu() returns the engine's own buffer, which its next step may reuse
            self._pending.setdefault(request, []).append(
                (
                    positions.long().to("cpu", copy=True),
                    hidden.detach().to("cpu", copy=True),
                    aux.detach().to("cpu", copy=True),
                )
            )

    def commit(self, request: str, tokens: list[int]) -> int:
        """File `request`'s kept states under the prefixes of `tokens` (its prompt, then what it
        generated); -> how many positions it filed. A position past `tokens` (none should be) is dropped."""
        pieces = self._pending.pop(request, [])
        keys = prefix_keys(tokens)
        filed = 0
        for positions, hidden, aux in pieces:
            block = len(self._blocks)
            self._blocks.append((hidden, aux))
            for row, p in enumerate(positions.tolist()):
                if (
                    0 <= p < len(keys)
                ):  # a later computation of the same prefix replaces an earlier one
                    self._index[keys[p]] = (block, row)
                    filed += 1
        return filed

    def discard(self, request: str) -> None:
        self._pending.pop(request, None)

    def fill(self, tokens: list[int], hidden_out: torch.Tensor, aux_out: torch.Tensor) -> int:
        """Write the states of row `tokens` into hidden_out [T, H] and aux_out [T, A] (T >= len(tokens));
        -> the number of positions no kept computation covers (then nothing is written)."""
        found = [self._index.get(k) for k in prefix_keys(tokens)]
        missing = sum(f is None for f in found)
        if missing:
            return missing
        by_block: dict[int, tuple[list[int], list[int]]] = {}
        for p, (block, row) in enumerate(found):
            slots, rows = by_block.setdefault(block, ([], []))
            slots.append(p)
            rows.append(row)
        for block, (slots, rows) in by_block.items():
            hidden, aux = self._blocks[block]
            at, take = torch.tensor(slots), torch.tensor(rows)
            hidden_out[at.to(hidden_out.device)] = hidden[take].to(
                hidden_out.device, hidden_out.dtype
            )
            aux_out[at.to(aux_out.device)] = aux[take].to(aux_out.device, aux_out.dtype)
        return 0

    def clear(self) -> None:
        self._pending.clear()
        self._blocks.clear()
        self._index.clear()
