"""Atomic artifact writes: a reader sees the old file or the complete new one, never half of one."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from spec_cli.errors import ArtifactError, is_disk_full
from spec_cli.paths import special_kind

SCHEMA_VERSION = 1


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DiskFullError(ArtifactError):
    """A write that found no room: the folder, what it was writing, and what is free."""


def disk_full(folder: Path, what: str, need: int | None = None) -> DiskFullError:
    """The one line for a write into `folder` that ran out of room (`need`: its bytes, where known)."""
    from spec_cli.console import human_bytes

    try:
        free = human_bytes(shutil.disk_usage(folder).free)
    except OSError:
        free = "an unknown amount"
    needs = f"it needs about {human_bytes(need)} and " if need else ""
    return DiskFullError(
        f"no space left on the device holding {folder} while writing {what}: {needs}{free} is free",
        "free space there or write elsewhere, then rerun the same command (nothing "
        "half-written was kept; the work finished before was)",
    )


@contextlib.contextmanager
def atomic_path(path: Path, need: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it into place. A disk that
    fills meanwhile is a DiskFullError naming the folder (`need`: the bytes being written, if known)."""
    path = Path(path)
    if path.is_dir():  # say so before any work, naming the user's path (not the temporary one)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    special = special_kind(path)
    if special:  # a device, a pipe, a socket: never replaced (--force or not)
        raise ArtifactError(
            f"{path} is {special}, not a file this command may write",
            "pass the path of a regular file",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except Exception as exc:
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            tmp.unlink(missing_ok=True)  # its room first, then the free space is measured
            raise disk_full(path.parent, path.name, need) from exc
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success rename it to `path` (replacing it)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    with atomic_dir_from(tmp, path) as folder:
        yield folder


@contextlib.contextmanager
def atomic_dir_from(staged: Path, path: Path) -> Iterator[Path]:
    """atomic_dir with a temporary folder made beforehand (`staged`, beside `path`, which several
    processes filled): yield it; on success rename it to `path` (replacing it); on failure remove it."""
    staged, path = Path(staged), Path(path)
    try:
        try:
            yield staged
        except Exception as exc:
            if is_disk_full(exc) and not isinstance(exc, DiskFullError):
                shutil.rmtree(staged, ignore_errors=True)
                raise disk_full(path.parent, f"{path.name}/", None) from exc
            raise
        os.chmod(staged, 0o777 & ~_umask())
        for file in staged.rglob(
            "*"
        ):  # some writers create 0600 files; give them normal permissions
            if file.is_file():
                os.chmod(file, 0o666 & ~_umask())
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(staged, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staged, path)
        _fsync_dir(path.parent)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)


# safetensors' save_file writes through a temporary file of its own beside the target (Rust's tempfile:
# `.tmp` + 6 characters) and renames it: a process killed mid-save leaves that behind
SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}$")


def remove_temporaries(folder: Path, names: str = r"[^/]+") -> list[str]:
    """Remove what killed atomic writes left in `folder`: atomic_path's and atomic_dir's temporaries
    (`.NAME.XXXX.tmp`, files or folders), atomic_dir's replaced folder (`.NAME.old`), for NAMEs
    matching the regex `names`, and safetensors' own temporary files (SAFETENSORS_TMP). Call it only while holding the folder's lock (no live writer owns them).
    The names removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    pattern = re.compile(rf"\.({names})(\.[^./]+\.tmp|\.old)$")
    removed = sorted(
        p
        for p in folder.iterdir()
        if pattern.match(p.name) or (SAFETENSORS_TMP.match(p.name) and p.is_file())
    )
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [p.name for p in removed]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    """Write tensors + JSON metadata (under the `spec_cli` key) atomically."""
    meta = {"spec_cli": json.dumps(metadata, sort_keys=True)}
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_path(path, need=sum(t.numel() * t.element_size() for t in tensors.values())) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def write_json(path: Path, data: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_path(path: Path) -> str:
    """Content hash of a file, or of every file in a folder (names included)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()


def read_safetensors(path: Path, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Read every tensor and the spec_cli metadata of a file written by `write_safetensors`."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{kind} not found: {path}", "check the path")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = (f.metadata() or {}).get("spec_cli")
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(
            f"{path} is not a readable safetensors file ({exc})", f"rebuild the {kind}"
        ) from exc
    if raw_meta is None:
        raise ArtifactError(
            f"{path} has no spec_cli metadata, so it is not a spec_cli {kind}",
            "build it with spec_cli",
        )
    return tensors, json.loads(raw_meta)
