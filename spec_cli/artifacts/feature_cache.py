"""The offline feature cache: a folder of safetensors shards + manifest.json.

Storage is ragged: the tokens of all samples of a shard are concatenated (padding is never stored) and
`sample_offsets` / `batch_offsets` say where samples and batches start. Per token:

  encoding `hidden` (default): aux_hidden [n*H] + final_hidden [H] in the storage dtype, argmax (int32),
                               lse (fp32); `head.safetensors` holds the draft-vocab rows of the frozen
                               lm_head once, so the loader rebuilds target_p / position_mask.
  encoding `probs`:            aux_hidden [n*H], target_p [Vd] in the storage dtype, argmax, target_mass.

The storage dtype (`--storage-dtype`, default the model dtype) is what the float features are kept in;
the loader upcasts them to the model dtype. argmax, lse and target_mass are computed from the
full-precision states before they are stored, and the head stays in the model dtype.

Both also store input_ids (int32) and loss_mask (uint8), so training needs nothing but the cache.
Shard i always holds the same batches whatever the number of ranks, so a resumed or re-split run
writes identical files.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from spec_cli.artifacts import io
from spec_cli.artifacts.io import SCHEMA_VERSION, atomic_path, sha256_file, write_json
from spec_cli.batch import EXTRA
from spec_cli.errors import ArtifactError

KIND = "feature_cache"
MANIFEST = "manifest.json"
HEAD = "head.safetensors"
ENCODINGS = ("hidden", "probs")
# Keys that must match for a cache to be resumed or trained from, in the order they are reported.
IDENTITY_KEYS = (
    "target_fingerprint",
    "chat_template_sha256",
    "tokenizer_fingerprint",
    "vocab_map_fingerprint",
    "aux_layers",
    "encoding",
    "dtype",
    "storage_dtype",
    "data_fingerprint",
    "max_length",
    "batch_tokens",
    "shard_tokens",
)
# Identity keys recorded only when they hold something, and their value when absent: the per-token
# fields a draft algorithm asked for beyond the built-in supervision (name -> width; `extra.NAME`).
IDENTITY_ABSENT = {"extra_fields": {}}
# Keys a cache written before they existed may lack; the keys after them cover them (the tokenizer
# fingerprint hashes the chat template), so such a cache stays usable.
OPTIONAL_IDENTITY_KEYS = ("chat_template_sha256",)
# Keys a cache written before they existed lacks, and the key that held their value then (a cache
# without `storage_dtype` stored its features in the model dtype).
IDENTITY_DEFAULTS = {"storage_dtype": "dtype"}
# The `spec precompute` option behind an identity key, named when a resume is refused over it.
IDENTITY_OPTIONS = {
    "aux_layers": "--aux-layers",
    "encoding": "--encoding",
    "dtype": "--dtype",
    "storage_dtype": "--storage-dtype",
    "max_length": "--max-length",
    "batch_tokens": "--batch-tokens",
    "shard_tokens": "--shard-tokens",
    "data_fingerprint": "--data / --max-samples",
    "extra_fields": "--algorithm",
}
DTYPE_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# Allowances for what is not tensor data: a shard's safetensors header (tensor table + identity) and
# its sidecar, the head's header, and the manifest (target config + one entry per shard).
SHARD_OVERHEAD = 1232 + 208
HEAD_OVERHEAD = 512
MANIFEST_OVERHEAD, MANIFEST_PER_SHARD = 3072, 232


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def bytes_per_token(
    encoding: str,
    hidden_size: int,
    draft_vocab_size: int,
    storage_dtype: str,
    num_aux: int,
    extra_width: int = 0,
) -> int:
    """Bytes a stored token takes: the float features (num_aux aux states, then the final hidden state
    or the draft-vocab probabilities, then the extra fields' extra_width values) in the storage dtype,
    plus input_ids (int32), loss_mask (uint8), argmax (int32) and lse / target_mass (fp32)."""
    size = DTYPE_SIZE[storage_dtype]
    ids_and_mask = 4 + 1 + extra_width * size
    if encoding == "hidden":
        return (num_aux * hidden_size + hidden_size) * size + 4 + 4 + ids_and_mask
    return (num_aux * hidden_size + draft_vocab_size) * size + 4 + 4 + ids_and_mask


def shard_bytes(tokens: int, samples: int, batches: int, per_token: int) -> int:
    """A shard's file (tokens, offsets, sample ids, header) and its sidecar."""
    return tokens * per_token + 8 * (2 * samples + 1) + 8 * (batches + 1) + SHARD_OVERHEAD


def head_bytes(
    vocab_size: int,
    hidden_size: int,
    draft_vocab_size: int,
    dtype: str,
    bias: bool = False,
    final_norm: bool = True,
) -> int:
    """head.safetensors: embed_tokens [V, H] and lm_head_selected [Vd, H] in the model dtype (bias
    [Vd] when the head has one), selected_token_ids int64 [Vd], t2d bool [V], final_norm fp32 [H]."""
    size = DTYPE_SIZE[dtype]
    return (
        (vocab_size + draft_vocab_size) * hidden_size * size
        + (draft_vocab_size * size if bias else 0)
        + 8 * draft_vocab_size
        + vocab_size
        + (4 * hidden_size if final_norm else 0)
        + HEAD_OVERHEAD
    )


def manifest_bytes(num_shards: int, target_config: dict) -> int:
    """manifest.json: identity and totals, the target's config (indented), one entry per shard."""
    return (
        MANIFEST_OVERHEAD
        + len(json.dumps(target_config, indent=2))
        + MANIFEST_PER_SHARD * num_shards
    )


def folder_bytes(folder: Path) -> dict[str, int]:
    """What a cache folder holds on disk: shards (with sidecars), head, manifest, total."""
    sizes = {"shards": 0, "head": 0, "manifest": 0}
    for path in Path(folder).iterdir():
        if not path.is_file():
            continue
        if path.name == HEAD:
            sizes["head"] += path.stat().st_size
        elif path.name == MANIFEST:
            sizes["manifest"] += path.stat().st_size
        elif path.name.startswith("shard-"):
            sizes["shards"] += path.stat().st_size
    return {**sizes, "total": sum(sizes.values())}


_OWN = re.compile(r"shard-\d{5}\.(safetensors|json)$")


def remove_temporaries(folder: Path) -> list[str]:
    """Remove the half-written files a killed precompute left (atomic writes' `.NAME.XXXX.tmp`); call
    it only while holding the cache's lock, so no live writer owns them. The names removed."""
    return io.remove_temporaries(
        folder, r"shard-\d{5}\.(safetensors|json)|" + re.escape(HEAD) + "|" + re.escape(MANIFEST)
    )


def own_files(folder: Path) -> list[str]:
    """The names in `folder` a cache writes (head, shards, sidecars; the manifest is the marker)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [p.name for p in folder.iterdir() if p.name == HEAD or _OWN.match(p.name)]


def rebuild_hint(folder: Path, manifest: dict | None = None) -> str:
    """The command that rebuilds the cache in `folder` from scratch."""
    m = manifest or {}
    args = (
        " ".join(
            f"{flag} {m[key]}"
            for flag, key in (("-t", "target"), ("-d", "data"), ("-v", "vocab_map"))
            if m.get(key)
        )
        or "..."
    )
    return f"rebuild it: `spec precompute {args} ... --no-resume -o {folder}` (the options it was made with)"


def identity_mismatch(expected: dict, found: dict) -> str | None:
    """The first identity key whose values differ, phrased for the user (with the option behind it),
    or None."""
    for key in IDENTITY_KEYS:
        if key in OPTIONAL_IDENTITY_KEYS and key not in found:
            continue
        value = (
            found.get(key, found.get(IDENTITY_DEFAULTS[key]))
            if key in IDENTITY_DEFAULTS
            else found.get(key)
        )
        if expected.get(key) != value:
            option = f" ({IDENTITY_OPTIONS[key]})" if key in IDENTITY_OPTIONS else ""
            return f"{key.replace('_', ' ')}: cache has {value!r}, this run has {expected.get(key)!r}{option}"
    for key, absent in IDENTITY_ABSENT.items():
        value, wanted = found.get(key) or absent, expected.get(key) or absent
        if wanted != value:
            return f"{key.replace('_', ' ')}: cache has {value!r}, this run has {wanted!r} ({IDENTITY_OPTIONS[key]})"
    return None


# ----------------------------------------------------------------------------- writing


def write_shard(folder: Path, index: int, tensors: dict[str, torch.Tensor], identity: dict) -> dict:
    """Write one shard atomically (temp file, fsync, rename) and its checksum sidecar."""
    meta = {
        "spec_cli": json.dumps(
            {"kind": "feature_cache_shard", "shard": index, "identity": identity}, sort_keys=True
        )
    }
    data = safetensors_bytes({k: v.contiguous().cpu() for k, v in tensors.items()}, metadata=meta)
    path = Path(folder) / shard_name(index)
    with atomic_path(path, need=len(data)) as tmp:
        tmp.write_bytes(data)
    entry = {
        "file": path.name,
        "shard": index,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "samples": int(tensors["sample_offsets"].numel() - 1),
        "batches": int(tensors["batch_offsets"].numel() - 1),
        "tokens": int(tensors["input_ids"].numel()),
    }
    write_json(path.with_suffix(".json"), entry)
    return entry


def completed_shard(folder: Path, index: int, identity: dict) -> dict | None:
    """The sidecar entry of a shard that is complete and verified, else None (caller recomputes).

    A shard from a different cache identity is an error, never silently replaced or mixed in."""
    path = Path(folder) / shard_name(index)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["spec_cli"])
    except Exception:
        return None  # unreadable: recompute it
    mismatch = identity_mismatch(identity, meta.get("identity", {}))
    if mismatch:
        raise ArtifactError(
            f"{path} was made differently ({mismatch})",
            "write to a new output folder, or pass --no-resume to replace the cache",
        )
    sidecar = path.with_suffix(".json")
    digest = sha256_file(path)
    try:
        entry = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        entry = None
    if entry is None or entry.get("sha256") != digest:
        if entry is not None:
            return None  # checksum mismatch: the file was damaged
        with safe_open(str(path), framework="pt") as f:  # killed between shard and sidecar
            shapes = {
                k: f.get_slice(k).get_shape()
                for k in ("sample_offsets", "batch_offsets", "input_ids")
            }
        entry = {
            "file": path.name,
            "shard": index,
            "bytes": path.stat().st_size,
            "sha256": digest,
            "samples": shapes["sample_offsets"][0] - 1,
            "batches": shapes["batch_offsets"][0] - 1,
            "tokens": shapes["input_ids"][0],
        }
        write_json(sidecar, entry)
    return entry


def write_head(
    folder: Path,
    lm_head_selected: torch.Tensor,
    bias_selected: torch.Tensor | None,
    selected_token_ids: torch.Tensor,
    t2d: torch.Tensor,
    softcap: float | None,
    embed_tokens: torch.Tensor,
    final_norm: torch.Tensor | None = None,
) -> None:
    """Stored once per cache: the draft-vocab rows of the frozen lm_head (the `hidden` encoding
    rebuilds target_p from them), the vocab map, and the input embeddings that seed the draft."""
    tensors = {
        "lm_head_selected": lm_head_selected,
        "selected_token_ids": selected_token_ids.long(),
        "t2d": t2d.bool(),
        "embed_tokens": embed_tokens,
    }
    if bias_selected is not None:
        tensors["bias_selected"] = bias_selected
    if final_norm is not None:
        tensors["final_norm"] = final_norm
    meta = {"spec_cli": json.dumps({"kind": "feature_cache_head", "softcap": softcap})}
    with atomic_path(Path(folder) / HEAD) as tmp:
        tmp.write_bytes(
            safetensors_bytes({k: v.contiguous().cpu() for k, v in tensors.items()}, metadata=meta)
        )


def write_manifest(folder: Path, identity: dict, info: dict, shards: list[dict]) -> dict:
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        **identity,
        **info,
        "num_shards": len(shards),
        "num_samples": sum(s["samples"] for s in shards),
        "num_batches": sum(s["batches"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "shards": sorted(shards, key=lambda s: s["shard"]),
    }
    write_json(Path(folder) / MANIFEST, manifest)
    return manifest


# ----------------------------------------------------------------------------- reading


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        hint = (
            "the precompute run did not finish; rerun the same `spec precompute` command to resume"
            if any(Path(folder).glob("shard-*.safetensors"))
            else "run `spec precompute` first"
        )
        raise ArtifactError(f"{folder} has no {MANIFEST}", hint)
    manifest = json.loads(path.read_text())
    if manifest.get("kind") != KIND or manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{folder} is not a feature cache of schema {SCHEMA_VERSION}",
            "rebuild it with `spec precompute`",
        )
    return manifest


ENCODING_KEYS = {"hidden": ("final_hidden", "lse"), "probs": ("target_p", "target_mass")}
COMMON_KEYS = (
    "input_ids",
    "loss_mask",
    "aux_hidden",
    "argmax",
    "sample_offsets",
    "batch_offsets",
    "sample_index",
)


def _shapes(path: Path) -> dict[str, list[int]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def check_files(folder: Path, manifest: dict) -> None:
    """The cheap check on every read: each shard (and the head) is there with the size the manifest
    records (a manifest without sizes: the safetensors header's own size check), and the tensors have
    the keys and widths the manifest's encoding, aux_layers and sizes say. ArtifactError otherwise,
    naming the file and the command that rebuilds the cache."""
    folder = Path(folder)
    hint = rebuild_hint(folder, manifest)
    wrong = []
    for entry in manifest.get("shards", []):
        path = folder / entry["file"]
        if not path.is_file():
            wrong.append(f"{entry['file']} is missing")
        elif entry.get("bytes") is not None and path.stat().st_size != entry["bytes"]:
            wrong.append(
                f"{entry['file']} has {path.stat().st_size} bytes, the manifest says {entry['bytes']} "
                "(truncated or damaged)"
            )
    head = folder / HEAD
    if not head.is_file():
        wrong.append(f"{HEAD} is missing")
    elif manifest.get("head_bytes") is not None and head.stat().st_size != manifest["head_bytes"]:
        wrong.append(
            f"{HEAD} has {head.stat().st_size} bytes, the manifest says {manifest['head_bytes']} "
            "(truncated or damaged)"
        )
    if wrong:
        raise ArtifactError(
            f"the feature cache {folder} is damaged: {'; '.join(wrong[:3])}"
            f"{f' (+{len(wrong) - 3} more)' if len(wrong) > 3 else ''}",
            hint,
        )
    encoding = manifest.get("encoding")
    if encoding not in ENCODINGS:
        raise ArtifactError(
            f"{folder / MANIFEST} names encoding {encoding!r}, not one of {', '.join(ENCODINGS)}",
            hint,
        )
    n_aux, hidden = len(manifest.get("aux_layers") or []), manifest.get("hidden_size")
    for entry in manifest.get("shards", []):
        path = folder / entry["file"]
        try:
            shapes = _shapes(path)
        except Exception as exc:  # a header that does not match the file (truncated, overwritten)
            raise ArtifactError(
                f"{path} is not a readable safetensors file ({exc}); the cache is damaged", hint
            ) from None
        missing = [k for k in (*COMMON_KEYS, *ENCODING_KEYS[encoding]) if k not in shapes]
        if missing:
            raise ArtifactError(
                f"{path} lacks {', '.join(missing)}, which encoding {encoding!r} in "
                f"{MANIFEST} needs (was the manifest edited?)",
                hint,
            )
        width = shapes["aux_hidden"][-1]
        if hidden and width != n_aux * hidden:
            raise ArtifactError(
                f"{path} stores aux states {width} wide, but {MANIFEST} says {n_aux} aux layers "
                f"x hidden_size {hidden} = {n_aux * hidden} (was the manifest edited?)",
                hint,
            )
        if encoding == "hidden" and hidden and shapes["final_hidden"][-1] != hidden:
            raise ArtifactError(
                f"{path} stores final states {shapes['final_hidden'][-1]} wide, {MANIFEST} says "
                f"hidden_size {hidden}",
                hint,
            )
        for name, field_width in (manifest.get("extra_fields") or {}).items():
            key = EXTRA + name
            if key not in shapes or shapes[key][-1] != field_width:
                found = f"{shapes[key][-1]} wide" if key in shapes else "nothing"
                raise ArtifactError(
                    f"{path} stores {found} for the field {name!r}, {MANIFEST} says "
                    f"{field_width} wide (was the manifest edited?)",
                    hint,
                )
        vd = manifest.get("draft_vocab_size")
        if encoding == "probs" and vd and shapes["target_p"][-1] != vd:
            raise ArtifactError(
                f"{path} stores {shapes['target_p'][-1]} draft-vocab probabilities, {MANIFEST} "
                f"says draft_vocab_size {vd}",
                hint,
            )


def shard_matches(folder: Path, entry: dict) -> bool:
    """The shard of a manifest entry is there and its sha256 is the entry's."""
    path = Path(folder) / entry["file"]
    return path.is_file() and sha256_file(path) == entry.get("sha256")


def verify_shards(folder: Path, manifest: dict) -> list[str]:
    """The shard files whose sha256 differs from the manifest's (or that are missing)."""
    return [
        entry["file"] for entry in manifest.get("shards", []) if not shard_matches(folder, entry)
    ]


@dataclass
class ShardIndex:
    path: Path
    sample_offsets: torch.Tensor  # [S+1] token offsets within the shard
    batch_offsets: torch.Tensor  # [nb+1] sample offsets within the shard
    sample_index: torch.Tensor  # [S] index in the tokenised data


class FeatureCacheReader:
    """Memory-mapped access to a complete cache: tokens, the batch plan, and per-sample features."""

    def __init__(self, folder: Path, verify: bool = False):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.shards: list[ShardIndex] = []
        self._handles: dict[int, object] = {}
        check_files(self.folder, self.manifest)
        if verify:
            damaged = verify_shards(self.folder, self.manifest)
            if damaged:
                raise ArtifactError(
                    f"{self.folder}: {', '.join(damaged)} "
                    f"{'fails its checksum' if len(damaged) == 1 else 'fail their checksums'}",
                    rebuild_hint(self.folder, self.manifest),
                )
        for entry in self.manifest["shards"]:
            path = self.folder / entry["file"]
            with safe_open(str(path), framework="pt") as f:
                self.shards.append(
                    ShardIndex(
                        path,
                        f.get_tensor("sample_offsets"),
                        f.get_tensor("batch_offsets"),
                        f.get_tensor("sample_index"),
                    )
                )

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.shards[shard].path), framework="pt")
        return self._handles[shard]

    def head(self) -> tuple[dict[str, torch.Tensor], dict]:
        with safe_open(str(self.folder / HEAD), framework="pt") as f:
            meta = json.loads(f.metadata()["spec_cli"])
            return {k: f.get_tensor(k) for k in f.keys()}, meta

    def locations(self):
        """(shard, token_start, token_end, global_sample_id) for every sample, in cache order."""
        gid = 0
        for s, index in enumerate(self.shards):
            offs = index.sample_offsets.tolist()
            for j in range(len(offs) - 1):
                yield s, offs[j], offs[j + 1], gid
                gid += 1

    def batches(self) -> list[list[int]]:
        """The stored batch plan as lists of global sample ids (cache order)."""
        plan, base = [], 0
        for index in self.shards:
            b = index.batch_offsets.tolist()
            plan.extend([list(range(base + b[k], base + b[k + 1])) for k in range(len(b) - 1)])
            base += b[-1]
        return plan

    def read(self, shard: int, name: str, start: int, end: int) -> torch.Tensor:
        return self._handle(shard).get_slice(name)[start:end]

    def close(self) -> None:
        self._handles.clear()
