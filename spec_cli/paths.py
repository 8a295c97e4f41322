"""Where spec_cli keeps its cache: SPEC_HOME, default ~/.cache/spec_cli."""

import os
from pathlib import Path


def spec_home() -> Path:
    return Path(os.environ.get("SPEC_HOME") or Path.home() / ".cache" / "spec_cli").expanduser()
