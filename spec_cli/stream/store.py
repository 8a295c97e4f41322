"""A bounded store of produced samples (named tensors + JSON metadata): in memory, or in a folder.

At most `max_samples` samples and `max_bytes` bytes are held at once. A put that would exceed a
bound waits until the consumer releases samples (or raises StoreFullError when asked not to block,
or when its timeout passes); a sample that alone exceeds `max_bytes` could never fit and raises
SampleTooLargeError at once. close() wakes every waiting put (StoreClosedError) and frees every sample.

Bytes are what the store really holds: the distinct tensor storages of a sample in memory (views of
one buffer count once), the file size in a folder. Space is reserved before a sample is written, so
the bound holds while writes are in flight too.

MemoryStore   tensors kept as given (same device, no copy).
FolderStore   one safetensors file per sample (metadata in the file's header), in a folder that
              belongs to this store alone: a trainer's producer threads and its consumer, in one
              process. A sample file appears whole (written aside, then renamed); close() deletes
              the folder. Files are not fsynced: the store is a queue for a live run, not an artifact.

Both are safe between the threads of one process; neither is shared between processes.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.errors import ConfigError, SpecError

SUFFIX = ".safetensors"
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_TMP = re.compile(r"\.(?P<id>.+)\.(?P<nbytes>\d+)\.tmp")


class StoreError(SpecError):
    """The stream store refused or lost a sample."""


class StoreFullError(StoreError):
    """A put that would exceed a bound, made with block=False or past its timeout."""


class StoreClosedError(StoreError):
    """The store was closed (the run is shutting down)."""


class SampleTooLargeError(StoreError):
    """One sample exceeds max_bytes, so no amount of waiting would make it fit."""


@dataclass
class Sample:
    tensors: dict[str, torch.Tensor]
    metadata: dict


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes the tensors keep alive: each distinct storage once (views of one buffer count once)."""
    storages = {}
    for t in tensors.values():
        s = t.untyped_storage()
        storages[(t.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


class FeatureStore:
    """The bounds, the waiting and the statistics; subclasses hold the samples."""

    kind = "base"

    def __init__(self, max_samples: int | None = None, max_bytes: int | None = None):
        for name, value in (("max_samples", max_samples), ("max_bytes", max_bytes)):
            if value is not None and value < 1:
                raise ConfigError(
                    f"the stream store's {name} must be at least 1, got {value}",
                    "e.g. --stream-max-bytes 4294967296 (4 GiB)",
                )
        self.max_samples, self.max_bytes = max_samples, max_bytes
        self._cond = threading.Condition()
        self._closed = False
        self._writing = 0  # puts between reservation and commit
        self._stats = {
            "puts": 0,
            "released": 0,
            "evicted": 0,
            "put_waits": 0,
            "put_wait_s": 0.0,
            "peak_samples": 0,
            "peak_bytes": 0,
        }

    # ------------------------------------------------------------------ what subclasses implement
    def _prepare(self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict):
        """(payload, nbytes) for a sample, made before any lock is taken."""
        raise NotImplementedError

    def _reserve(self, sample_id: str, payload, nbytes: int) -> tuple[int, int] | None:
        """Under the lock: reserve room and return (samples, bytes) held now, or None if it does not fit."""
        raise NotImplementedError

    def _write(self, sample_id: str, payload) -> None:
        """Outside the lock: fill the reserved room."""

    def _commit(self, sample_id: str) -> None:
        """Under the lock: make the written sample visible to get()."""

    def _abandon(self, sample_id: str) -> None:
        """Under the lock: drop a reservation whose put failed."""
        self._remove(sample_id)

    def _remove(self, sample_id: str) -> bool:
        raise NotImplementedError

    def _clear(self) -> int:
        """Remove every sample; how many there were."""
        raise NotImplementedError

    def _usage(self) -> tuple[int, int]:
        raise NotImplementedError

    def get(self, sample_id: str) -> Sample:
        raise NotImplementedError

    # ------------------------------------------------------------------ the interface
    def put(
        self,
        sample_id: str,
        tensors: dict[str, torch.Tensor],
        metadata: dict | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> int:
        """Store a sample; return its bytes. Waits while a bound would be exceeded (block=True)."""
        if not _ID.fullmatch(sample_id):
            raise StoreError(
                f"bad sample id {sample_id!r}", "use letters, digits, '_', '.' and '-'"
            )
        payload, nbytes = self._prepare(sample_id, tensors, metadata or {})
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise SampleTooLargeError(
                f"one streamed sample holds {_mb(nbytes)}, more than the store's bound of "
                f"{_mb(self.max_bytes)}, so it could never fit",
                "raise --stream-max-bytes, or lower --batch-tokens / --max-length",
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            waited_from = None
            try:
                while True:
                    if self._closed:
                        raise StoreClosedError(
                            "the stream store is closed", "the run is shutting down"
                        )
                    held = self._reserve(sample_id, payload, nbytes)
                    if held is not None:
                        break
                    if not block or (deadline is not None and time.monotonic() >= deadline):
                        samples, used = self._usage()
                        raise StoreFullError(
                            f"the stream store is full ({samples} samples, {_mb(used)}; bounds "
                            f"{self.max_samples} samples, {_mb(self.max_bytes or 0)})",
                            "release samples first, or put with block=True",
                        )
                    if waited_from is None:
                        waited_from = time.monotonic()
                        self._stats["put_waits"] += 1
                    self._cond.wait(
                        None if deadline is None else max(0.0, deadline - time.monotonic())
                    )
            finally:
                if waited_from is not None:
                    self._stats["put_wait_s"] += time.monotonic() - waited_from
            self._stats["peak_samples"] = max(self._stats["peak_samples"], held[0])
            self._stats["peak_bytes"] = max(self._stats["peak_bytes"], held[1])
            self._writing += 1
        committed = False
        try:
            self._write(sample_id, payload)
            with self._cond:
                if self._closed:
                    raise StoreClosedError(
                        "the stream store was closed during a put", "the run is shutting down"
                    )
                self._commit(sample_id)
                committed = True
                self._stats["puts"] += 1
        finally:
            with self._cond:
                if not committed:
                    self._abandon(sample_id)
                self._writing -= 1
                self._cond.notify_all()
        return nbytes

    def release(self, sample_id: str) -> None:
        """The consumer is done with a sample: free it (and wake a waiting put)."""
        with self._cond:
            if not self._remove(sample_id):
                raise StoreError(
                    f"no sample {sample_id!r} in the stream store to release",
                    "release each sample once, after get()",
                )
            self._stats["released"] += 1
            self._cond.notify_all()

    def evict(self, sample_id: str) -> bool:
        """Free a sample nobody will consume (its reference was dropped). False if it was not there."""
        with self._cond:
            removed = self._remove(sample_id)
            if removed:
                self._stats["evicted"] += 1
                self._cond.notify_all()
            return removed

    def take(self, sample_id: str) -> Sample:
        """get() then release()."""
        sample = self.get(sample_id)
        self.release(sample_id)
        return sample

    def close(self, wait_s: float = 30.0) -> None:
        """Wake every waiting put (StoreClosedError), let puts mid-write finish, free every sample."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            deadline = time.monotonic() + wait_s
            while self._writing and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._stats["evicted"] += self._clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._cond:
            return self._usage()[0]

    @property
    def nbytes(self) -> int:
        with self._cond:
            return self._usage()[1]

    def health(self) -> dict:
        """Size, bounds, peaks and waits."""
        with self._cond:
            samples, used = self._usage()
            return {
                "backend": self.kind,
                "samples": samples,
                "bytes": used,
                "max_samples": self.max_samples,
                "max_bytes": self.max_bytes,
                "closed": self._closed,
                **self._stats,
            }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MemoryStore(FeatureStore):
    """Samples kept as the producer made them (same device, no copy)."""

    kind = "memory"

    def __init__(self, max_samples: int | None = None, max_bytes: int | None = None):
        super().__init__(max_samples, max_bytes)
        self._samples: dict[str, Sample | None] = {}  # None: reserved
        self._bytes: dict[str, int] = {}

    def _prepare(self, sample_id, tensors, metadata):
        return Sample(dict(tensors), json.loads(json.dumps(metadata))), tensor_bytes(tensors)

    def _reserve(self, sample_id, payload, nbytes):
        if sample_id in self._samples:
            raise StoreError(
                f"sample {sample_id!r} is already in the stream store", "use unique ids"
            )
        samples, used = self._usage()
        if (self.max_samples is not None and samples + 1 > self.max_samples) or (
            self.max_bytes is not None and used + nbytes > self.max_bytes
        ):
            return None
        self._samples[sample_id], self._bytes[sample_id] = payload, nbytes
        return samples + 1, used + nbytes

    def _remove(self, sample_id):
        self._bytes.pop(sample_id, None)
        return self._samples.pop(sample_id, None) is not None

    def _clear(self):
        n = sum(s is not None for s in self._samples.values())
        self._samples.clear()
        self._bytes.clear()
        return n

    def _usage(self):
        return len(self._samples), sum(self._bytes.values())

    def get(self, sample_id):
        with self._cond:
            sample = self._samples.get(sample_id)
        if sample is None:
            raise StoreError(
                f"no sample {sample_id!r} in the stream store",
                "a sample can be read until it is released or evicted",
            )
        return sample


class FolderStore(FeatureStore):
    """One `<id>.safetensors` file per sample in `folder`, which belongs to this store (one process).

    A put reserves its room as `.<id>.<nbytes>.tmp` (its size is in the name, so a reservation counts
    in full before it is written), writes it, and renames it to `<id>.safetensors`.
    close() deletes every sample and the folder (when empty).
    """

    kind = "folder"

    def __init__(self, folder: Path, max_samples: int | None = None, max_bytes: int | None = None):
        super().__init__(max_samples, max_bytes)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._mine: dict[str, Path] = {}  # reservations not yet committed

    def _path(self, sample_id: str) -> Path:
        return self.folder / f"{sample_id}{SUFFIX}"

    def _entries(self) -> Iterator[tuple[str, int, Path | None]]:
        """(sample id, bytes, reservation file or None) for everything the folder holds."""
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.name
            if name.endswith(SUFFIX) and not name.startswith("."):
                try:
                    yield name[: -len(SUFFIX)], entry.stat().st_size, None
                except FileNotFoundError:  # released meanwhile
                    continue
            elif m := _TMP.fullmatch(name):
                yield m["id"], int(m["nbytes"]), Path(entry.path)

    def _usage(self):
        samples = used = 0
        for _, nbytes, _ in self._entries():
            samples, used = samples + 1, used + nbytes
        return samples, used

    def _prepare(self, sample_id, tensors, metadata):
        from safetensors.torch import save

        cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        data = save(cpu, metadata={"spec_cli": json.dumps(metadata, sort_keys=True)})
        return data, len(data)

    def _reserve(self, sample_id, payload, nbytes):
        samples = used = 0
        for other, size, _ in self._entries():
            if other == sample_id:
                raise StoreError(
                    f"sample {sample_id!r} is already in the stream folder {self.folder}",
                    "use unique sample ids (prefix them with a run id)",
                )
            samples, used = samples + 1, used + size
        if (self.max_samples is not None and samples + 1 > self.max_samples) or (
            self.max_bytes is not None and used + nbytes > self.max_bytes
        ):
            return None
        tmp = self.folder / f".{sample_id}.{nbytes}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileNotFoundError:
            raise StoreError(
                f"the stream folder {self.folder} is gone",
                "something deleted it during the run; keep it for this trainer alone",
            ) from None
        self._mine[sample_id] = tmp
        return samples + 1, used + nbytes

    def _write(self, sample_id, payload):
        with open(self._mine[sample_id], "r+b") as f:
            f.write(payload)

    def _commit(self, sample_id):
        try:
            os.replace(self._mine.pop(sample_id), self._path(sample_id))
        except FileNotFoundError:
            raise StoreError(
                f"the stream folder {self.folder} is gone",
                "something deleted it during the run; keep it for this trainer alone",
            ) from None

    def _abandon(self, sample_id):
        tmp = self._mine.pop(sample_id, None)
        if tmp is not None:
            tmp.unlink(missing_ok=True)

    def _remove(self, sample_id):
        try:
            self._path(sample_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def _clear(self):
        for sample_id in list(self._mine):  # reservations of puts that never finished
            self._abandon(sample_id)
        n = 0
        for sample_id, _, tmp in list(self._entries()):
            if tmp is None:
                n += self._remove(sample_id)
            else:  # a stray reservation file
                tmp.unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:  # not empty: files that are not the store's; leave them
            pass
        return n

    def get(self, sample_id):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self._path(sample_id)), framework="pt") as f:
                metadata = json.loads((f.metadata() or {}).get("spec_cli", "{}"))
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except FileNotFoundError:
            raise StoreError(
                f"no sample {sample_id!r} in the stream folder {self.folder}",
                "a sample can be read until it is released or evicted",
            ) from None
        except (SafetensorError, OSError, ValueError) as exc:
            raise StoreError(
                f"the stream sample {self._path(sample_id)} is unreadable ({exc})",
                "check the disk holding --stream-dir",
            ) from exc
        return Sample(tensors, metadata)
