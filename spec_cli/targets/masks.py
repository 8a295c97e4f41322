"""Attention masks for inputs a 2D padding mask cannot describe, per kind of attention layer: several
documents packed in one row (supervision for training) and a draft tree (verification in `spec eval`).

A transformers decoder builds one mask per layer kind (`config.layer_types`) from CACHE INDICES, which
are the token positions only for one plain sequence. These masks apply each kind's rule to the tokens'
real positions instead (q: the query's position, k: the key's), on top of what the caller allows
(causal within a document, or ancestors in a tree):

    full_attention     every allowed key
    sliding_attention  q - k < sliding_window          (transformers' sliding_window_overlay)
    chunked_attention  q // chunk == k // chunk        (transformers' chunked_overlay, chunks from 0)

Any other kind (linear attention / Mamba states, conv states, compressed or indexed keys, ...) keeps a
state or picks keys across the whole row, which no mask confines to one document or to one tree path:
those targets are refused with that reason.

A model with one kind takes one 4D mask; a model with several takes a dict keyed by kind (every
transformers model with mixed layer_types accepts one: `isinstance(attention_mask, dict)`). sdpa reads
a bool mask (True = attend) as is; eager adds a float mask (0, or the dtype's minimum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_cli.errors import ConfigError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
KINDS = (FULL, SLIDING, CHUNKED)  # the kinds a mask expresses
CUSTOM_MASK_ATTENTION = ("sdpa", "eager")  # implementations that read a 4D mask as given


def text_config(config):
    """The decoder's config (Gemma 3 and other multimodal targets nest it in text_config)."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class Layout:
    """Which attention each decoder layer runs, and the sizes its rule needs."""

    layer_types: tuple[str, ...]  # per decoder layer, the config's names
    sliding_window: int | None = None
    chunk_size: int | None = None

    @classmethod
    def from_config(cls, config) -> Layout:
        """config.layer_types, or what transformers infers without it (get_layer_types_and_kwargs): every
        layer sliding when the config sets sliding_window (Mistral), chunked when attention_chunk_size."""
        text = text_config(config)
        window = getattr(text, "sliding_window", None)
        chunk = getattr(text, "attention_chunk_size", None)
        types = getattr(text, "layer_types", None)
        if not types:
            kind = SLIDING if window is not None else CHUNKED if chunk is not None else FULL
            types = [kind] * int(getattr(text, "num_hidden_layers", 1) or 1)
        return cls(
            tuple(types),
            int(window) if window is not None else None,
            int(chunk) if chunk is not None else None,
        )

    @property
    def kinds(self) -> list[str]:
        """The distinct kinds, in layer order."""
        return list(dict.fromkeys(self.layer_types))

    def problem(self) -> str | None:
        """Why masks cannot express this target's attention, or None when they can."""
        other = [k for k in self.kinds if k not in KINDS]
        if other:
            return (
                f"its {', '.join(other)} layers keep a state over the whole sequence (or choose keys "
                "across it), which neither an attention mask nor a cache rollback can confine"
            )
        if SLIDING in self.kinds and not self.sliding_window:
            return "it has sliding_attention layers but no sliding_window in its config"
        if CHUNKED in self.kinds and not self.chunk_size:
            return "it has chunked_attention layers but no attention_chunk_size in its config"
        return None

    def packs_by_positions(self) -> bool:
        """Whether packed documents can be given as positions alone (restarting at 0 per document, no
        mask), as transformers reads them for attentions that take no custom mask (flash attention's
        varlen call, one per packed row): its full and sliding rules apply within a document by the
        tokens' distance. Chunked attention counts chunks from the row's start there, not from each
        document's, so it needs the masks."""
        return self.problem() is None and CHUNKED not in self.kinds

    def require(self, what: str, instead: str) -> None:
        """ConfigError naming `what` cannot be done on this target, and why."""
        why = self.problem()
        if why is not None:
            raise ConfigError(f"{what} is not exact on this target: {why}", instead)

    def rule(self, kind: str, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Bool, broadcast of q_pos [..., n, 1] and k_pos [..., 1, L]: the keys `kind` lets a query see
        among those the caller allows (causality is the caller's); None: all of them (full attention)."""
        if kind == SLIDING:
            return q_pos - k_pos < self.sliding_window
        if kind == CHUNKED:
            return torch.div(q_pos, self.chunk_size, rounding_mode="floor") == torch.div(
                k_pos, self.chunk_size, rounding_mode="floor"
            )
        return None

    def restrict(
        self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """{kind: allowed & rule}. allowed [B, 1, n, L] bool, q_pos [B, n], k_pos [B, L] long."""
        masks = {}
        for kind in self.kinds:
            rule = self.rule(kind, q_pos[:, None, :, None], k_pos[:, None, None, :])
            masks[kind] = allowed if rule is None else allowed & rule
        return masks

    def packed(
        self, seq_lens: torch.Tensor, T: int, blocks: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({kind: mask [B, 1, T, T] bool}, position_ids [B, T]) for rows of documents of seq_lens [B, D]:
        causal within each document, positions restart per document; padding sees only itself.
        blocks [B, T]: tokens of one block (>= 0; -1: none) also see each other both ways, inside
        their document and each kind's rule (Gemma 3's images: AND(window, OR(causal, block)))."""
        docs, positions = document_ids(seq_lens, T)  # [B, T] each
        index = torch.arange(T, device=seq_lens.device)
        causal = index[None, :, None] >= index[None, None, :]
        if blocks is not None:
            blocks = blocks.to(seq_lens.device)
            causal = causal | (
                (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
            )
        same = (docs[:, :, None] == docs[:, None, :]) & causal
        return self.restrict(same[:, None], positions, positions), positions

    def tree(self, allowed: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """{kind: mask [1, 1, n, past + n]} for n new tokens at `positions` [1, n] after `past` cached
        ones at positions 0..past-1 (a verification); allowed [n, past + n] bool (the tree's ancestors)."""
        past = allowed.shape[1] - positions.shape[1]
        keys = torch.cat([torch.arange(past, device=positions.device)[None], positions], dim=1)
        return self.restrict(allowed[None, None], positions, keys)


def document_ids(seq_lens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index [B, T], position in the document [B, T]) of rows packed with seq_lens [B, D].
    Each padding token is a document of its own (-1, -2, ...) at position 0."""
    B = seq_lens.shape[0]
    docs = torch.empty(B, T, dtype=torch.long, device=seq_lens.device)
    positions = torch.zeros(B, T, dtype=torch.long, device=seq_lens.device)
    for b in range(B):
        lengths = [int(n) for n in seq_lens[b].tolist() if n > 0]
        start = 0
        for d, n in enumerate(lengths):
            docs[b, start : start + n] = d
            positions[b, start : start + n] = torch.arange(n, device=seq_lens.device)
            start += n
        docs[b, start:] = -1 - torch.arange(T - start, device=seq_lens.device)
    return docs, positions


def for_model(masks: dict[str, torch.Tensor], implementation: str, dtype: torch.dtype, what: str):
    """What the model's `attention_mask` takes: the one mask, or {kind: mask} for mixed kinds; bool
    for sdpa, additive float (0 / dtype min) for eager."""
    if implementation == "eager":
        low = torch.finfo(dtype).min
        masks = {
            k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, low)
            for k, m in masks.items()
        }
    elif implementation != "sdpa":
        raise ConfigError(
            f"{what} needs a custom attention mask, which the target's {implementation!r} "
            "attention does not take",
            f"load the target with {' or '.join(CUSTOM_MASK_ATTENTION)} attention",
        )
    return next(iter(masks.values())) if len(masks) == 1 else masks


def image_blocks(token_types: torch.Tensor) -> torch.Tensor:
    """[B, T] block index of each run of image tokens (type 1), -1 elsewhere: the tokens a Gemma 3 image
    spans, which attend each other both ways."""
    image = token_types == 1
    before = torch.nn.functional.pad(image, (1, 0), value=False)[:, :-1]
    starts = torch.cumsum((image & ~before).long(), dim=1) - 1
    return torch.where(image, starts, torch.full_like(starts, -1))
