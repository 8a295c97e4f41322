"""Tokenised chat data: ragged token ids + loss mask, concatenated with offsets (no padding)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec_cli.artifacts.io import SCHEMA_VERSION, read_safetensors, write_safetensors
from spec_cli.errors import ArtifactError

KIND = "tokenized_data"


@dataclass
class TokenizedData:
    input_ids: torch.Tensor  # [N_tokens] int32, all samples concatenated
    loss_mask: torch.Tensor  # [N_tokens] uint8
    offsets: torch.Tensor  # [N_samples + 1] int64: sample i is input_ids[offsets[i]:offsets[i+1]]
    source_index: torch.Tensor  # [N_samples] int64: the record each sample came from
    metadata: dict = field(default_factory=dict)
    # image-text data (data/vlm.py): each sample's image count, and the per-token types the model reads
    # beside the ids where its processor gives them (metadata["token_type_key"] names the argument)
    num_images: torch.Tensor | None = None  # [N_samples] int32
    token_types: torch.Tensor | None = None  # [N_tokens] uint8
    images: object = (
        None  # at run time: data.vlm.ImageInputs, the model inputs for a batch's images
    )

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


def save_tokenized(data: TokenizedData, path: Path) -> None:
    meta = {**data.metadata, "kind": KIND, "schema_version": SCHEMA_VERSION}
    tensors = {
        "input_ids": data.input_ids,
        "loss_mask": data.loss_mask,
        "offsets": data.offsets,
        "source_index": data.source_index,
    }
    for name in ("num_images", "token_types"):
        if getattr(data, name) is not None:
            tensors[name] = getattr(data, name)
    write_safetensors(path, tensors, meta)


def load_tokenized(path: Path) -> TokenizedData:
    tensors, meta = read_safetensors(path, "tokenised data")
    if meta.get("kind") != KIND or meta.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} is not tokenised data of schema {SCHEMA_VERSION}",
            "delete it; it is rebuilt from the chat data",
        )
    return TokenizedData(
        tensors["input_ids"],
        tensors["loss_mask"],
        tensors["offsets"],
        tensors["source_index"],
        meta,
        tensors.get("num_images"),
        tensors.get("token_types"),
    )
