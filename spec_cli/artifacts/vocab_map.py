"""The vocab map: which target token ids make up the draft vocabulary.

Semantics (docs/eagle.md "Vocab map"): the `Vd` most frequent target ids at supervised positions,
ties broken by the lower id, padded with the lowest unused ids when fewer than `Vd` occur, sorted
ascending.
`d2t[i] = selected[i] - i` is an offset (target_id = draft_id + d2t[draft_id]); `t2d` is a bool mask
over the target vocab. These are the buffers vLLM and SGLang read; the functions under "d2t / t2d" are
the only place spec_cli converts between them and the selected ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec_cli.artifacts.io import SCHEMA_VERSION, read_safetensors, write_safetensors
from spec_cli.errors import ArtifactError, ConfigError

KIND = "vocab_map"
# Sizes at which coverage is reported besides the chosen one, so a user can pick Vd.
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32000, 65536)


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id at supervised positions. [V] int64."""
    ids = input_ids[loss_mask.bool()].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ArtifactError(
            f"token ids outside the target vocab (0..{vocab_size - 1})",
            "the tokenised data does not come from this tokenizer; re-tokenise",
        )
    return torch.bincount(ids, minlength=vocab_size)


def select_token_ids(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Top-`Vd` ids by count, ties by lower id, sorted ascending. [Vd] int64."""
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ConfigError(
            f"--draft-vocab-size {draft_vocab_size} is larger than the target vocab ({vocab_size})",
            f"use at most {vocab_size}",
        )
    if draft_vocab_size < 1:
        raise ConfigError("--draft-vocab-size must be at least 1", "use e.g. 32000")
    # A stable sort on -count keeps ids in ascending order among equal counts (zero counts too,
    # which is the padding rule).
    order = torch.sort(-counts.long(), stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def coverage_by_size(counts: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Fraction of counted tokens whose id is among the top-`s` ids, for each size `s`."""
    total = int(counts.sum())
    cumulative = torch.cumsum(torch.sort(counts.long(), descending=True).values, 0)
    return {
        s: (int(cumulative[min(s, counts.numel()) - 1]) / total if total else 0.0) for s in sizes
    }


# ----------------------------------------------------------------------------- d2t / t2d


def d2t_from_ids(selected: torch.Tensor) -> torch.Tensor:
    """Offsets: target_id = draft_id + d2t[draft_id] (vLLM's draft_id_to_target_id). [Vd] int64."""
    selected = selected.long()
    return selected - torch.arange(selected.numel(), device=selected.device)


def ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id: arange(Vd) + d2t (vLLM's compute_logits, SGLang's
    hot_token_id). [Vd] int64."""
    d2t = d2t.long()
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids (any shape) -> target-vocab ids through the d2t offsets."""
    return draft_ids + d2t[draft_ids]


def t2d_from_ids(selected: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """True for every target id in the draft vocab. [V] bool."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=selected.device)
    mask[selected.long()] = True
    return mask


def ids_from_t2d(t2d: torch.Tensor) -> torch.Tensor:
    """The target ids a t2d mask marks, ascending. [Vd] int64."""
    return t2d.bool().nonzero().flatten()


def valid_ids(selected: torch.Tensor, vocab_size: int) -> bool:
    """Ascending, distinct and inside the target vocab [0, vocab_size): what d2t/t2d can encode."""
    selected = selected.long()
    if selected.numel() and (int(selected.min()) < 0 or int(selected.max()) >= vocab_size):
        return False
    return bool((selected[1:] > selected[:-1]).all())


@dataclass
class VocabMap:
    selected_token_ids: torch.Tensor  # [Vd] int64, ascending target ids
    counts: torch.Tensor  # [V] int64
    metadata: dict = field(default_factory=dict)

    @property
    def draft_vocab_size(self) -> int:
        return self.selected_token_ids.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.counts.numel()

    @property
    def d2t(self) -> torch.Tensor:
        """Offsets: target_id = draft_id + d2t[draft_id]. [Vd] int64."""
        return d2t_from_ids(self.selected_token_ids)

    @property
    def t2d(self) -> torch.Tensor:
        """True for every target id in the draft vocab. [V] bool."""
        return t2d_from_ids(self.selected_token_ids, self.target_vocab_size)

    @property
    def fingerprint(self) -> str:
        ids = self.selected_token_ids.to(torch.int64).contiguous().numpy().tobytes()
        return hashlib.sha256(ids + str(self.target_vocab_size).encode()).hexdigest()[:16]

    @property
    def coverage(self) -> float:
        total = int(self.counts.sum())
        return int(self.counts[self.selected_token_ids].sum()) / total if total else 0.0


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int, metadata: dict) -> VocabMap:
    counts = counts.to(torch.int64)
    if int(counts.sum()) == 0:
        raise ArtifactError(
            "the data has no supervised tokens to count",
            "check that the records have assistant turns with text",
        )
    selected = select_token_ids(counts, draft_vocab_size)
    vocab_map = VocabMap(selected, counts)
    sizes = sorted({s for s in COVERAGE_SIZES if s < counts.numel()} | {draft_vocab_size})
    vocab_map.metadata = {
        **metadata,
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": counts.numel(),
        "num_tokens_counted": int(counts.sum()),
        "num_distinct_tokens": int((counts > 0).sum()),
        "coverage": vocab_map.coverage,
        "coverage_by_size": {str(k): v for k, v in coverage_by_size(counts, sizes).items()},
        "fingerprint": vocab_map.fingerprint,
    }
    return vocab_map


def save_vocab_map(vocab_map: VocabMap, path: Path) -> None:
    tensors = {
        "selected_token_ids": vocab_map.selected_token_ids,
        "d2t": vocab_map.d2t,
        "t2d": vocab_map.t2d,
        "counts": vocab_map.counts,
    }
    write_safetensors(path, tensors, vocab_map.metadata)


def load_vocab_map(path: Path) -> VocabMap:
    if Path(path).is_dir():
        raise _a_folder(Path(path))
    tensors, meta = read_safetensors(path, "vocab map")
    if meta.get("kind") != KIND:
        raise ArtifactError(
            f"{path} is a {meta.get('kind')!r} artifact, not a vocab map",
            "pass the file written by `spec build-vocab-map`",
        )
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has vocab-map schema {meta.get('schema_version')}, this "
            f"spec_cli reads {SCHEMA_VERSION}",
            "rebuild it with `spec build-vocab-map`",
        )
    missing = {"selected_token_ids", "d2t", "t2d", "counts"} - tensors.keys()
    if missing:
        raise ArtifactError(
            f"{path} lacks {sorted(missing)}", "rebuild it with `spec build-vocab-map`"
        )
    vocab_map = VocabMap(tensors["selected_token_ids"].long(), tensors["counts"].long(), meta)
    # The stored d2t/t2d must agree with the ids: these buffers are what serving engines read.
    if not (
        torch.equal(tensors["d2t"].long(), vocab_map.d2t)
        and torch.equal(tensors["t2d"].bool(), vocab_map.t2d)
    ):
        raise ArtifactError(
            f"{path} is inconsistent: d2t/t2d do not match selected_token_ids",
            "the file was modified; rebuild it with `spec build-vocab-map`",
        )
    return vocab_map


def _a_folder(path: Path) -> ArtifactError:
    """--vocab-map given a folder: what the folder is, and where the vocab map it was made with is."""
    import json

    from spec_cli.artifacts.guard import folder_kind

    kind = folder_kind(path) or "a folder"
    recorded = None
    try:
        if (path / "run.json").is_file():
            recorded = json.loads((path / "run.json").read_text())["options"].get("vocab_map")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if recorded:
        hint = f"pass the vocab map file the run was trained with: {recorded}"
    elif "feature cache" in kind:
        hint = (
            "pass the vocab map file the cache was made with (`spec precompute -v`; the cache keeps a copy "
            "of its ids in head.safetensors, but not the file)"
        )
    else:
        hint = "pass the .safetensors file `spec build-vocab-map` wrote"
    return ArtifactError(f"--vocab-map {path} is {kind}, not a vocab map file", hint)
