"""Folders a command may replace, and folders one command writes at a time.

Two rules keep a user's files safe:
- a command removes a folder only when it carries this project's marker file for that kind of
  artifact (a cache's manifest, a run's run.json), and never when the folder holds the command's
  own inputs or files the project did not write;
- a folder being written is locked with an OS file lock (`flock`), which the kernel drops when the
  process exits or is killed, so a crashed run never leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from spec_cli.errors import ArtifactError

LOCK = ".spec.lock"


def inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or somewhere under it (links resolved)."""
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(folder))
        return True
    except ValueError:
        return False


# What marks a folder as one of the project's artifacts (or a model), in the order they are told apart.
_KINDS = (
    ("run.json", "a training run"),
    ("trainer_state.json", "a checkpoint of a training run"),
    ("manifest.json", "a feature cache"),
    ("demo.json", "a spec demo folder"),
    ("eval.json", "a spec eval folder"),
    ("state.json", "a spec regenerate work folder"),
)


def folder_kind(folder: Path) -> str | None:
    """What `folder` is ("a feature cache", "a training run", ...), or None for a folder of none of the
    project's kinds (or no folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for marker, kind in _KINDS:
        if (folder / marker).is_file():
            return kind
    from spec_cli.artifacts import feature_cache

    # a precompute stopped before its manifest: its head (written first) or shards
    if feature_cache.own_files(folder):
        return "an unfinished feature cache"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return "a model (or an exported draft)"
    return None


def check_replaceable(
    folder: Path, marker: str, kind: str, inputs: Iterable[Path] = (), own: Iterable[str] = ()
) -> None:
    """Refuse (one line, the folder and the way out) unless `folder` may be removed and rewritten.

    It may when it is empty, or when it holds `marker` (this project's file for `kind`), none of
    `inputs`, and nothing at its top level but `marker`, names in `own` and hidden work files.
    """
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ArtifactError(
            f"{folder} is a file, not a {kind} folder",
            "pass an --output folder that does not exist yet, or remove that file yourself",
        )
    real = Path(os.path.realpath(folder))
    if real == Path(os.path.realpath(Path.home())) or real.parent == real:
        raise ArtifactError(
            f"refusing to replace {folder}: it is the home or root folder",
            "pass a new --output folder",
        )
    for path in inputs:
        if path is not None and inside(Path(path), folder):
            raise ArtifactError(
                f"refusing to replace {folder}: it holds this command's input {path}",
                "write to a new --output folder",
            )
    entries = [
        p.name for p in folder.iterdir() if p.name != LOCK
    ]  # a lock file alone: an empty folder
    if not entries:
        return
    if marker not in entries:
        raise ArtifactError(
            f"refusing to replace {folder}: it is not a {kind} (no {marker} in it)",
            "write to a new --output folder, or empty that folder yourself",
        )
    allowed = {marker, *own}
    foreign = sorted(n for n in entries if n not in allowed and not n.startswith("."))
    if foreign:
        raise ArtifactError(
            f"refusing to replace {folder}: besides the {kind} it holds "
            f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}",
            "move those files out, or write to a new --output folder",
        )


def replace_folder(
    folder: Path, marker: str, kind: str, inputs: Iterable[Path] = (), own: Iterable[str] = ()
) -> None:
    """Remove `folder` after `check_replaceable` allows it (the lock file, if held, stays)."""
    folder = Path(folder)
    check_replaceable(folder, marker, kind, inputs, own)
    if not folder.exists():
        return
    for entry in folder.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


class FolderLock:
    """An exclusive OS lock on `folder` while a command writes it.

    `with FolderLock(run_dir, "spec train"):` raises ArtifactError at once, naming the other
    process, when another command holds it. The kernel releases the lock when this process exits,
    however it exits, so nothing stale is left to clean up.
    """

    def __init__(self, folder: Path, command: str):
        self.folder = Path(folder)
        self.command = command
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ArtifactError(
                    f"{self.folder} is in use by {holder}",
                    "wait for it to finish or stop it, or write to another folder",
                ) from None
            raise
        os.ftruncate(fd, 0)
        try:  # who holds it, for the message another command prints: worth no failure on a full disk
            os.pwrite(fd, f"`{self.command}` (pid {os.getpid()})\n".encode(), 0)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                os.close(fd)
                raise
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(
                self._fd
            )  # closing drops the flock; the file stays (harmless, rewritten next time)
            self._fd = None
