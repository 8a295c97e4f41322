"""Tokenise a chat data set: parallel, deterministic, and cached under SPEC_HOME.

The cache key is the data's content hash, the tokenizer fingerprint (vocab, merges, chat template,
special tokens), --max-length and the version of the masking rules, so a second run on the same data
and tokenizer loads the result instead of redoing it.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from spec_cli.artifacts.io import sha256_path
from spec_cli.artifacts.tokens import TokenizedData, load_tokenized, save_tokenized
from spec_cli.console import info, progress
from spec_cli.data import chat_templates, records, vlm
from spec_cli.data.images import check_images
from spec_cli.data.records import load_records
from spec_cli.data.template import encode_record, special_token_strings
from spec_cli.errors import DataError
from spec_cli.paths import spec_home

# Bump when the masking or truncation rules change: old caches are then not reused.
# 2: answers cut at the length limit do not supervise the end-of-turn token
# 3: records a template refuses because they begin with an assistant turn are counted apart
# 4: image-text records are counted apart (records.IMAGES), not as malformed
# 5: image-text records through the target's processor (data/vlm.py)
TOKENIZE_VERSION = "5"
CHUNK = 256  # records per work item
# The slowest tokenising to plan a wait for: ShareGPT (121 MB) went through SmolLM2's tokenizer at
# 0.32 MB/s in one process on a 2-core machine another job kept busy; a tenth of a slow rate's speed.
MIN_BYTES_PER_S = 50e3
# ... and per image an image-text record refers to (opened and run through the processor's image part,
# data/vlm.py): a generous bound for one image on a slow core; a reference costs a few bytes of the file
SECONDS_PER_IMAGE = 0.5
IMAGE_MARKS = (
    b'"image',
    b"<image>",
)  # image parts and keys ("image", "images", "image_url"), ShareGPT markers

# Worker state (set in the parent before forking, or by the pool initializer).
_worker: dict = {}


def _init_worker(
    tokenizer, dataset, max_length: int, processor=None, base: Path | None = None
) -> None:
    _worker.update(
        tokenizer=tokenizer,
        dataset=dataset,
        max_length=max_length,
        specials=special_token_strings(tokenizer),
        processor=processor,
        base=base,
        renderer=None if processor is None else vlm.chat_template_tokenizer(processor, tokenizer),
    )


def _encode_range(bounds: tuple[int, int]) -> list:
    start, stop = bounds
    rows = _worker["dataset"][start:stop]  # dict of columns
    names = list(rows)
    out = []
    for j in range(stop - start):
        record = {name: rows[name][j] for name in names}
        if _worker["processor"] is not None and records.has_images(record):
            out.append(
                vlm.encode_image_record(
                    _worker["processor"],
                    _worker["renderer"],
                    record,
                    _worker["base"],
                    _worker["max_length"],
                    _worker["specials"],
                )
            )
            continue
        out.append(
            encode_record(_worker["tokenizer"], record, _worker["max_length"], _worker["specials"])
        )
    return out


def has_conversations(dataset, probe: int = 1000) -> bool:
    """Some of the first `probe` records hold a chat (`conversations` / `messages`)."""
    for column in ("conversations", "messages"):
        if column in dataset.column_names and any(
            v is not None for v in dataset.select_columns(column)[:probe][column]
        ):
            return True
    return False


def cache_key(
    data_fingerprint: str, tokenizer_fp: str, max_length: int, images_fp: str = ""
) -> str:
    text = f"{TOKENIZE_VERSION}|{data_fingerprint}|{tokenizer_fp}|{max_length}" + (
        f"|{images_fp}" if images_fp else ""
    )
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def tokenize_seconds_bound(data_path: Path) -> float:
    """How long tokenising `data_path` may take at most (MIN_BYTES_PER_S, and SECONDS_PER_IMAGE for each
    image a JSON file refers to; images stored in a parquet file count by their bytes): what other ranks
    wait for."""
    path = Path(data_path).expanduser()
    files = (
        [path]
        if path.is_file()
        else [p for p in path.rglob("*") if p.is_file()]
        if path.is_dir()
        else []
    )
    images = sum(_image_marks(f) for f in files if f.suffix in (".json", ".jsonl"))
    return sum(f.stat().st_size for f in files) / MIN_BYTES_PER_S + images * SECONDS_PER_IMAGE


def _image_marks(path: Path, chunk: int = 1 << 24) -> int:
    """How many IMAGE_MARKS the file holds (an upper bound on its image references), read in chunks."""
    count, tail = 0, b""
    keep = max(len(m) for m in IMAGE_MARKS) - 1  # a mark split across two chunks is counted once
    with open(path, "rb") as f:
        while block := f.read(chunk):
            data = tail + block
            count += sum(data.count(m) for m in IMAGE_MARKS)
            tail = data[-keep:]
            count -= sum(
                tail.count(m) for m in IMAGE_MARKS
            )  # whole marks in the tail: counted next time
    return count + sum(tail.count(m) for m in IMAGE_MARKS)


def tokenize_data(
    data_path: Path,
    tokenizer,
    tokenizer_fp: str,
    max_length: int = 2048,
    num_proc: int = 1,
    use_cache: bool = True,
    processor=None,
    load_processor: Callable[[], object] | None = None,
) -> TokenizedData:
    """Token ids + loss masks for every usable record; skip counts in `.metadata["skipped"]`.
    `processor` (a vision-language target's, loading.load_processor): image-text records go through it
    (data/vlm.py), their images all opened first; without one they are counted apart and skipped.
    `load_processor`: makes it, called only when the data holds image-text records (a processor may need
    packages text data does not, e.g. Qwen-VL's torchvision)."""
    if max_length < 2:
        raise DataError(f"--max-length {max_length} is too small", "use at least 2 (default 2048)")
    data_path = Path(data_path).expanduser()
    if not data_path.exists():
        raise DataError(
            f"data not found: {data_path}",
            "pass a .jsonl, .json or .parquet file, a saved dataset folder, or `sharegpt`",
        )
    data_fp = sha256_path(data_path)[:20]
    dataset, images_fp = None, ""
    if processor is None and load_processor is not None:
        dataset = load_records(data_path)
        if any(records.has_images(record) for record in dataset):
            processor = load_processor()
    if (
        processor is not None
    ):  # the images are part of the data: checked, and their bytes in the key
        dataset = load_records(data_path) if dataset is None else dataset
        digest = hashlib.sha256(vlm.processor_fingerprint(processor).encode())
        if check_images(dataset, vlm.image_base(data_path), digest=digest):
            images_fp = digest.hexdigest()[:20]
    cache_file = (
        spec_home()
        / "tokenized"
        / f"{cache_key(data_fp, tokenizer_fp, max_length, images_fp)}.safetensors"
    )
    if use_cache and cache_file.is_file():
        info(f"tokenised data: reusing cache {cache_file}")
        data = load_tokenized(cache_file)
        data.metadata["cache_hit"] = True
        return _with_images(data, processor, data_path)

    dataset = load_records(data_path) if dataset is None else dataset
    if has_conversations(dataset):  # before tokenising: one error, not every record skipped
        chat_templates.require(
            tokenizer,
            getattr(tokenizer, "name_or_path", "") or "the target",
            f"the conversations in {data_path.name}",
        )
    n = len(dataset)
    ranges = [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]
    results: list = []
    if images_fp:  # one clear error before any record, not every image record skipped as "rejected"
        vlm.check_renders_images(processor, vlm.chat_template_tokenizer(processor, tokenizer))
    work = (
        tokenizer,
        dataset,
        max_length,
        processor if images_fp else None,
        vlm.image_base(data_path),
    )
    with progress("tokenising", total=n, unit="records") as bar:
        if num_proc <= 1 or len(ranges) <= 1:
            _init_worker(*work)
            for bounds in ranges:
                results.extend(_encode_range(bounds))
                bar.advance(bounds[1] - bounds[0])
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ctx.Pool(num_proc, initializer=_init_worker, initargs=work) as pool:
                # imap keeps record order, so the result does not depend on num_proc
                for chunk in pool.imap(_encode_range, ranges):
                    results.extend(chunk)
                    bar.advance(len(chunk))

    skipped = Counter(r for r in results if isinstance(r, str))
    if skipped[records.NO_TEMPLATE]:  # chat records in a data set whose columns did not say so
        chat_templates.require(
            tokenizer,
            getattr(tokenizer, "name_or_path", "") or "the target",
            f"the conversations in {data_path.name}",
        )
    kept = [(i, r) for i, r in enumerate(results) if not isinstance(r, str)]
    if not kept:
        reasons = ", ".join(f"{k}: {v}" for k, v in skipped.most_common()) or "no records"
        refused = skipped[records.TEMPLATE] + skipped[records.ASSISTANT_FIRST]
        hint = (
            "the chat template refuses these conversations: check that it renders user and assistant "
            "turns, or pass --chat-template with the template the target is served with"
            if refused * 2 > sum(skipped.values())
            else "records need an assistant turn (ShareGPT `conversations`, OpenAI `messages`) or a `text` field"
        )
        raise DataError(f"{data_path} has no usable records ({reasons})", hint)
    images = _image_fields([r for _, r in kept])
    lengths = np.array([len(r[0]) for _, r in kept], dtype=np.int64)
    offsets = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = TokenizedData(
        input_ids=torch.from_numpy(np.concatenate([r[0] for _, r in kept]).astype(np.int32)),
        loss_mask=torch.from_numpy(np.concatenate([r[1] for _, r in kept]).astype(np.uint8)),
        offsets=torch.from_numpy(offsets),
        source_index=torch.tensor([i for i, _ in kept], dtype=torch.int64),
        **{k: v for k, v in images.items() if k != "type_key"},
        metadata={
            "data_path": str(data_path.resolve()),
            "data_fingerprint": data_fp,
            "tokenizer_fingerprint": tokenizer_fp,
            "max_length": max_length,
            "num_records": n,
            "num_samples": len(kept),
            "skipped": dict(sorted(skipped.items())),
            "num_at_max_length": int(sum(1 for _, r in kept if len(r[0]) == max_length)),
        },
    )
    data.metadata.update(num_tokens=data.num_tokens, num_supervised=data.num_supervised)
    if data.num_images is not None:
        data.metadata.update(
            num_images=int(data.num_images.sum()),
            images_fingerprint=images_fp,
            token_type_key=images["type_key"],
        )
    if use_cache:
        save_tokenized(data, cache_file)
    data.metadata["cache_hit"] = False
    return _with_images(data, processor, data_path)


def _image_fields(kept: list[tuple]) -> dict:
    """TokenizedData's image fields from the kept samples (ids, mask[, (type key, types) or None, number
    of images]): none when no sample has an image."""
    if not any(len(r) > 2 for r in kept):
        return {}
    typed = [r[2] for r in kept if len(r) > 2 and r[2] is not None]
    types = [
        r[2][1] if len(r) > 2 and r[2] is not None else np.zeros(len(r[0]), dtype=np.uint8)
        for r in kept
    ]
    return {
        "num_images": torch.tensor([r[3] if len(r) > 2 else 0 for r in kept], dtype=torch.int32),
        "token_types": torch.from_numpy(np.concatenate(types).astype(np.uint8)) if typed else None,
        "type_key": typed[0][0] if typed else None,
    }


def _with_images(data: TokenizedData, processor, data_path: Path) -> TokenizedData:
    """Attach the reader of the samples' images (data.vlm.ImageInputs) when the data has any: read from
    `data_path` as given now (a cache hit may have been made from a copy elsewhere)."""
    if data.num_images is not None and int(data.num_images.sum()) and processor is not None:
        data.images = vlm.ImageInputs(
            processor,
            data_path,
            data.source_index,
            data.num_images,
            data.token_types,
            data.metadata.get("token_type_key"),
            data.offsets,
        )
    return data
