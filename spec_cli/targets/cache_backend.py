"""A target backend that answers from a feature cache instead of running the target.

The trainer forms batches from the cache's own tokens and asks for supervision exactly as it would ask
a live target; each row (or packed document) is found by the hash of its token ids, its stored features
are laid into the padded batch, and the same supervision functions as the live backend run on them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.artifacts.feature_cache import FeatureCacheReader
from spec_cli.artifacts.tokens import TokenizedData
from spec_cli.batch import EXTRA, TargetBatch
from spec_cli.errors import ArtifactError
from spec_cli.targets.backend import TargetBackend
from spec_cli.targets.supervision import assemble_batch, draft_distribution, selected_logits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HostBatch:
    """A cache batch's stored tensors (and the batch's inputs) by name, before decoding."""

    tensors: dict[str, torch.Tensor]

    def pin_memory(self) -> HostBatch:
        """In page-locked memory, so that `.to(cuda, non_blocking=True)` does not make the host wait."""
        return HostBatch({k: v.pin_memory() for k, v in self.tensors.items()})

    def to(self, device: torch.device, non_blocking: bool = False) -> HostBatch:
        return HostBatch(
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        )


def _key(ids: torch.Tensor) -> bytes:
    return hashlib.sha1(ids.to(torch.int32).contiguous().numpy().tobytes()).digest()


class CacheBackend(TargetBackend):
    def __init__(self, folder: Path, device: torch.device | str = "cpu", verify: bool = False):
        self.reader = FeatureCacheReader(folder, verify=verify)
        m = self.reader.manifest
        self.device = torch.device(device)
        self.encoding = m["encoding"]
        self.dtype = DTYPES[m["dtype"]]
        self.info = {
            k: m[k]
            for k in (
                "architecture",
                "vocab_size",
                "hidden_size",
                "num_layers",
                "aux_layers",
                "dtype",
                "target_fingerprint",
                "tokenizer_fingerprint",
                "vocab_map_fingerprint",
            )
        }
        head, head_meta = self.reader.head()
        self.selected = head["selected_token_ids"]
        self.t2d = head["t2d"].to(self.device)
        self.embed = head["embed_tokens"]
        self.softcap = head_meta.get("softcap")
        self.lm_head_selected = head.get("lm_head_selected")
        self.bias_selected = head.get("bias_selected")
        self.final_norm = head.get("final_norm")
        if self.lm_head_selected is not None:
            self.lm_head_selected = self.lm_head_selected.to(self.device)
        if self.bias_selected is not None:
            self.bias_selected = self.bias_selected.to(self.device)
        self._where: dict[bytes, tuple[int, int, int]] = {}
        self._locations: list[tuple[int, int, int]] = []  # cache sample id -> (shard, start, end)
        ids_parts, mask_parts, sample_index = [], [], []
        for shard, index in enumerate(self.reader.shards):
            ids = self.reader.read(shard, "input_ids", 0, int(index.sample_offsets[-1]))
            ids_parts.append(ids)
            mask_parts.append(
                self.reader.read(shard, "loss_mask", 0, int(index.sample_offsets[-1]))
            )
            sample_index.append(index.sample_index)
            offs = index.sample_offsets.tolist()
            for j in range(len(offs) - 1):
                self._where.setdefault(
                    _key(ids[offs[j] : offs[j + 1]]), (shard, offs[j], offs[j + 1])
                )
                self._locations.append((shard, offs[j], offs[j + 1]))
        ids = torch.cat(ids_parts)
        lengths = torch.cat(
            [ix.sample_offsets[1:] - ix.sample_offsets[:-1] for ix in self.reader.shards]
        )
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        self._tokens = TokenizedData(
            ids, torch.cat(mask_parts), offsets, torch.cat(sample_index), {"source": str(folder)}
        )
        if m.get(
            "image_samples"
        ):  # which samples hold images (MSD's curriculum tells batches apart by it)
            images = torch.isin(
                self._tokens.source_index, torch.tensor(m["image_samples"], dtype=torch.int64)
            )
            self._tokens.num_images = images.to(torch.int32)

    # ------------------------------------------------------------------ cache-specific
    def tokens(self) -> TokenizedData:
        """Every sample of the cache (cache order); train batches are formed from these."""
        return self._tokens

    def plan(self) -> list[list[int]]:
        return self.reader.batches()

    # ------------------------------------------------------------------ interface
    def get_input_embeddings(self) -> torch.Tensor:
        return self.embed

    def get_output_head(self) -> dict[str, torch.Tensor] | None:
        if self.lm_head_selected is None:
            return None
        head = {"lm_head_selected": self.lm_head_selected}
        if self.final_norm is not None:
            head["final_norm"] = self.final_norm
        return head

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        if not torch.equal(selected_token_ids.long().cpu(), self.selected.long()):
            raise ArtifactError(
                "the vocab map differs from the one the feature cache was made with",
                "pass the --vocab-map used for `spec precompute`, or precompute again",
            )

    def _segments(self, attention_mask: torch.Tensor, seq_lens: torch.Tensor | None):
        for b in range(attention_mask.shape[0]):
            lengths = (
                [int(attention_mask[b].sum())]
                if seq_lens is None
                else [int(x) for x in seq_lens[b] if int(x) > 0]
            )
            start = 0
            for n in lengths:
                yield b, start, start + n
                start += n

    reads_slots = True  # read_host(slots=...): a context-parallel rank's ranges of the rows only

    def generate_batch(
        self,
        input_ids,
        attention_mask,
        loss_mask,
        position_ids=None,
        seq_lens=None,
        slots=None,
        samples=None,
    ) -> TargetBatch:
        return self.finish(
            self.read_host(
                input_ids, attention_mask, loss_mask, position_ids, seq_lens, slots, samples
            ).to(self.device)
        )

    def read_host(
        self,
        input_ids,
        attention_mask,
        loss_mask,
        position_ids=None,
        seq_lens=None,
        slots: list[tuple[int, int]] | None = None,
        samples: list[int] | None = None,
    ) -> HostBatch:
        """The batch's stored features laid into padded host tensors: file reads and copies only, no
        device work (a reading thread runs this while the device trains; `finish` decodes on the device).
        slots: read only these ranges of the rows' slots, back to back (context parallelism: what one rank
        trains on; spec_cli/draft/context.py kept_ranges); the inputs stay whole rows. samples: the cache's
        sample ids of the rows' documents, in order: each is read by its id, not found by its tokens (image
        rows: two images of one size give the same placeholder ids and different features)."""
        B, T = input_ids.shape
        ranges = [(0, T)] if slots is None else [(int(a), int(b)) for a, b in slots]
        n = sum(b - a for a, b in ranges)
        H = self.info["hidden_size"]
        if self.keep_final_hidden and self.encoding != "hidden":
            raise ArtifactError(
                f"the feature cache was made with --encoding {self.encoding}, which keeps no "
                "final hidden states (EAGLE-1/2 trains on them)",
                "precompute it again with --encoding hidden (the default)",
            )
        stored = self.reader.manifest.get("extra_fields") or {}
        lacking = sorted(set(self.extra_fields) - set(stored))
        if lacking:
            raise ArtifactError(
                f"the feature cache holds no {', '.join(lacking)} (per-token field(s) the draft "
                "algorithm reads)",
                "precompute it again with this --algorithm",
            )
        fields = {
            EXTRA + name: torch.zeros(B, n, stored[name], dtype=self.dtype)
            for name in self.extra_fields
        }
        fields["aux_hidden"] = torch.zeros(B, n, len(self.info["aux_layers"]) * H, dtype=self.dtype)
        fields["argmax"] = torch.zeros(B, n, dtype=torch.long)
        if self.encoding == "hidden":
            fields["final_hidden"] = torch.zeros(B, n, H, dtype=self.dtype)
            fields["lse"] = torch.zeros(B, n, dtype=torch.float32)
        else:
            fields["target_p"] = torch.zeros(B, n, self.selected.numel(), dtype=torch.float32)
            fields["target_mass"] = torch.zeros(B, n, dtype=torch.float32)
        for k, (b, a, e) in enumerate(self._segments(attention_mask, seq_lens)):
            where = (
                self._locations[samples[k]]
                if samples is not None
                else self._where.get(_key(input_ids[b, a:e].cpu()))
            )
            if samples is not None and not torch.equal(
                self._tokens.sample(samples[k])[0].long(), input_ids[b, a:e].cpu().long()
            ):
                raise ArtifactError(
                    f"cache sample {samples[k]} does not hold this row's tokens", "precompute again"
                )
            if where is None:
                raise ArtifactError(
                    "a training sample is not in the feature cache",
                    "train from the cache's own data, or precompute this data",
                )
            shard, s, _ = where
            offset = 0
            for (
                lo,
                hi,
            ) in ranges:  # the part of the document [a, e) in each range, where the range sits
                x, y = max(a, lo), min(e, hi)
                if x < y:
                    for name, value in fields.items():
                        value[b, offset + x - lo : offset + y - lo] = self.reader.read(
                            shard, name, s + x - a, s + y - a
                        )
                offset += hi - lo
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "seq_lens": seq_lens,
            "slots": None if slots is None else torch.cat([torch.arange(a, b) for a, b in ranges]),
        }
        return HostBatch({**fields, **{k: v for k, v in inputs.items() if v is not None}})

    def finish(self, host: HostBatch) -> TargetBatch:
        """read_host's tensors (already on this backend's device) decoded into the TargetBatch: the
        target's distribution over the draft vocab from the stored final states (--encoding hidden)."""
        f = host.tensors
        if self.encoding == "hidden":
            sel = selected_logits(
                f["final_hidden"], self.lm_head_selected, self.bias_selected, self.softcap
            )
            target_p, target_mass = draft_distribution(sel, f["lse"])
        else:
            target_p, target_mass = f["target_p"], f["target_mass"]
        extras = {name: f[EXTRA + name] for name in self.extra_fields}
        return assemble_batch(
            f["aux_hidden"],
            f["input_ids"],
            f["attention_mask"],
            f["loss_mask"],
            target_p,
            target_mass,
            f["argmax"],
            self.t2d,
            f.get("position_ids"),
            f.get("seq_lens"),
            f["final_hidden"] if self.keep_final_hidden else None,
            extras,
            f.get("slots"),
        )

    def close(self) -> None:
        self.reader.close()
