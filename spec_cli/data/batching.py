"""Length-bucketed batches and right-padded collation.

The batch plan is a pure function of the sample lengths and `batch_tokens`, so precompute, the live
backend and the trainer all see the same groups with the same padding.
"""

from __future__ import annotations

import torch

from spec_cli.artifacts.tokens import TokenizedData
from spec_cli.errors import ConfigError


def plan_batches(
    lengths: torch.Tensor, batch_tokens: int, max_batch_size: int | None = None
) -> list[list[int]]:
    """Group samples of similar length: each batch's B * max_len <= batch_tokens.

    Samples are taken longest first (ties by index), so a batch's padding is the length spread of
    neighbours in sorted order. A sample longer than batch_tokens gets a batch of its own.
    """
    if batch_tokens < 1:
        raise ConfigError("--batch-tokens must be positive", "use e.g. 8192")
    order = torch.sort(-lengths.long(), stable=True).indices.tolist()
    batches: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for i in order:
        length = int(lengths[i])
        new_max = max(current_max, length)
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (new_max * (len(current) + 1) > batch_tokens or full):
            batches.append(current)
            current, new_max = [], length
        current.append(i)
        current_max = new_max
    if current:
        batches.append(current)
    return batches


def plan_by_source(
    lengths: torch.Tensor, batch_tokens: int, num_images: torch.Tensor | None = None
) -> list[list[int]]:
    """plan_batches, with image-text samples (num_images > 0) and text samples never in one batch: the
    text batches first, then the image-text ones (each planned as plan_batches plans)."""
    if num_images is None or not bool((num_images[: lengths.numel()] > 0).any()):
        return plan_batches(lengths, batch_tokens)
    images = num_images[: lengths.numel()] > 0
    batches = []
    for chosen in (~images, images):
        index = torch.nonzero(chosen).squeeze(1)
        batches += (
            [[int(index[j]) for j in b] for b in plan_batches(lengths[index], batch_tokens)]
            if len(index)
            else []
        )
    return batches


def collate(
    tokens: TokenizedData, indices: list[int], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, loss_mask), each [B, T] long."""
    lengths = [int(tokens.offsets[i + 1] - tokens.offsets[i]) for i in indices]
    T = max(lengths)
    input_ids = torch.full((len(indices), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), T), dtype=torch.long)
    loss_mask = torch.zeros((len(indices), T), dtype=torch.long)
    for row, (i, n) in enumerate(zip(indices, lengths)):
        ids, mask = tokens.sample(i)
        input_ids[row, :n] = ids.long()
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = mask.long()
    return input_ids, attention_mask, loss_mask


def padding_fraction(lengths: torch.Tensor, batches: list[list[int]]) -> float:
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    return 1 - real / padded if padded else 0.0


def plan_packed(lengths: torch.Tensor, row_tokens: int) -> list[list[int]]:
    """Pack samples into rows of at most row_tokens tokens (first-fit decreasing); one row per batch.

    A sample longer than row_tokens gets a row of its own. Each sample goes to the first row with
    room for it, found in a tree of the rows' free room (the most in each subtree): O(log rows) a
    sample, where scanning the open rows costs the square of the samples (bench/pack_plan.py)."""
    order = torch.sort(-lengths.long(), stable=True).indices.tolist()
    sizes = lengths.long().tolist()
    rows: list[list[int]] = []
    size = 1
    while size < max(len(order), 1):
        size *= 2
    room = [-1] * (2 * size)  # room[size + r]: row r's free tokens (-1: no row yet); inner: the max
    for i in order:
        n = sizes[i]
        if room[1] >= n:  # the leftmost row with room: go down, left first
            node = 1
            while node < size:
                node = 2 * node if room[2 * node] >= n else 2 * node + 1
            rows[node - size].append(i)
            left = room[node] - n
        else:
            node = size + len(rows)
            rows.append([i])
            left = max(row_tokens - n, 0)
        room[node] = left
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return rows


def collate_packed(
    tokens: TokenizedData, indices: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row: (input_ids, attention_mask, loss_mask) [1, T] and seq_lens [1, D]."""
    ids = torch.cat([tokens.sample(i)[0].long() for i in indices]).unsqueeze(0)
    loss = torch.cat([tokens.sample(i)[1].long() for i in indices]).unsqueeze(0)
    seq_lens = torch.tensor([[int(tokens.offsets[i + 1] - tokens.offsets[i]) for i in indices]])
    return ids, torch.ones_like(ids), loss, seq_lens
