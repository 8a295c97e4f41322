"""Where spec_cli keeps its cache (SPEC_HOME, default ~/.cache/spec_cli), and what a path is."""

import os
import stat
from pathlib import Path


def spec_home() -> Path:
    return Path(os.environ.get("SPEC_HOME") or Path.home() / ".cache" / "spec_cli").expanduser()


def special_kind(path) -> str | None:
    """ "a character device", "a named pipe", ... for a path that exists and is neither a regular file nor
    a folder (links followed); None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, TypeError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    for test, kind in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a special file"
