"""Where a command may write: one rule for every output of every command.

An output is never
- a device, a pipe or a socket, or anything in /dev (a command's result is files to keep, and its work
  would be lost);
- one of the command's inputs, inside one (a folder input), or a folder that holds one;
- the built-in assets, the home folder or the root folder;
- an existing file or folder of another kind: a model, a feature cache, a training run, an export,
  data the user wrote.
`--force` and `--overwrite` replace only an artifact of the same kind that spec_cli wrote; each stage
then decides what its own kind allows (resume, same inputs, replace). Every command calls `check`
with all its outputs and inputs before it does any work, so a refusal costs nothing and writes nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from spec_cli.artifacts.guard import folder_kind
from spec_cli.errors import ConfigError
from spec_cli.paths import spec_home, special_kind

EVAL_MARKER = (
    ".spec-eval"  # a spec eval folder, from its first turn on (eval.json comes at the end)
)


# spec_cli's own work files: a folder's lock, and what a write killed before its rename leaves behind
# (artifacts.io: `.NAME.XXXX.tmp`, `.NAME.old`, safetensors' `NAME.tmpXXXXXX`)
_WORK_FILE = re.compile(r"(\.spec\.lock|\..+\.tmp|\..+\.old|.+\.tmp[A-Za-z0-9]{6})")


@dataclass(frozen=True)
class Kind:
    """What a command writes at an output: its name in messages, a folder or a file, and how an existing
    one that spec_cli wrote is recognised."""

    name: str
    folder: bool
    ours: Callable[[Path], bool]


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _json_kind(name: str, kind: str) -> Callable[[Path], bool]:
    """A folder whose file `name` is a JSON object with "kind": `kind`."""
    return lambda folder: (_json(folder / name) or {}).get("kind") == kind


def _is_vocab_map(path: Path) -> bool:
    from spec_cli.artifacts.vocab_map import load_vocab_map
    from spec_cli.errors import SpecError

    try:
        load_vocab_map(path)
        return True
    except (SpecError, OSError, ValueError):
        return False


def _is_regenerated(path: Path) -> bool:
    meta = _json(path.with_name(path.name + ".meta.json")) or {}
    return (meta.get("identity") or {}).get("kind") == "regenerated_chat_data"


def _is_export(folder: Path) -> bool:
    record = (_json(folder / "config.json") or {}).get("spec_cli")
    return isinstance(record, dict) and record.get("kind") == "draft_export"


def _is_eval(folder: Path) -> bool:
    return (folder / EVAL_MARKER).is_file() or _json_kind("eval.json", "eval")(folder)


VOCAB_MAP = Kind("a vocab map", False, _is_vocab_map)
CHAT_DATA = Kind("chat data written by spec regenerate", False, _is_regenerated)
PLAN = Kind(
    "a plan written by spec plan", False, lambda path: (_json(path) or {}).get("kind") == "plan"
)
FEATURE_CACHE = Kind(
    "a feature cache",
    True,
    lambda folder: folder_kind(folder) in ("a feature cache", "an unfinished feature cache"),
)
# what spec train writes at a run folder's top level: a folder of these alone (no run.json: a run that
# stopped before writing it, or one whose user removed it) is still the run's
_RUN_NAMES = {
    "run.json",
    "log.jsonl",
    "checkpoints",
    "frozen.safetensors",
    "best",
    "engine-eval",
    "eval",
    "stream.json",
    "tensorboard",
    "training.png",
}


def _is_run(folder: Path) -> bool:
    names = {p.name for p in folder.iterdir() if not _WORK_FILE.fullmatch(p.name)}
    return folder_kind(folder) == "a training run" or bool(names) and names <= _RUN_NAMES


TRAINING_RUN = Kind("a training run", True, _is_run)
EXPORT = Kind("a spec export", True, _is_export)
EVAL = Kind("a spec eval folder", True, _is_eval)
TUNE = Kind("a spec tune folder", True, _json_kind("serving.json", "serving"))
DEMO = Kind("a spec demo folder", True, lambda folder: (folder / "demo.json").is_file())


def _real(path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def what_is(path: Path) -> str:
    """What an existing path is, in a message's words ("a feature cache", "a model", "a file of yours")."""
    path = Path(path)
    if special := special_kind(path):
        return special
    if path.is_dir():
        if _is_export(path):
            return "a spec export"
        if _is_eval(path):
            return "a spec eval folder"
        kind = folder_kind(path)
        if kind == "a spec eval folder":  # an eval.json that spec eval did not write
            kind = None
        return kind or "a folder holding files spec_cli did not write"
    if _is_regenerated(path):
        return "chat data written by spec regenerate"
    if path.suffix == ".safetensors":
        return (
            "a vocab map"
            if _is_vocab_map(path)
            else "a .safetensors file (weights or tensors) spec_cli did not write"
        )
    return "a file spec_cli did not write"


def _empty(folder: Path) -> bool:
    """Nothing in `folder` but spec_cli's own work files (a killed command's are no one else's)."""
    return all(_WORK_FILE.fullmatch(p.name) for p in folder.iterdir())


def _input_paths(inputs: Mapping[str, object]) -> list[tuple[str, Path, Path]]:
    """(option, as given, resolved) for each input that names something on disk (built-in names, hub ids
    and URLs name nothing here), and the built-in assets, which every command may read."""
    found = []
    for option, values in inputs.items():
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if value is None or str(value) == "":
                continue
            given = Path(str(value)).expanduser()
            if given.exists():
                found.append((option, given, _real(given)))
    assets = spec_home() / "assets"
    if assets.exists():
        found.append(("the built-in assets", assets, _real(assets)))
    return found


def check(
    outputs: Mapping[str, tuple[object, Kind]],
    inputs: Mapping[str, object],
    *,
    replace_flag: str | None = None,
    own_places: Iterable[Path] = (),
) -> None:
    """Refuse, in one line that names what would have been replaced, any output the rule forbids.

    `outputs`: option -> (path or None, the Kind the command writes there). `inputs`: option -> a path,
    a name or None (or a list of them). `own_places`: folders inside an input where this command keeps
    its results (spec eval's RUN/eval), which an output may be inside.
    """
    places = [_real(p) for p in own_places]
    found = _input_paths(inputs)
    given = {
        option: (Path(str(path)).expanduser(), kind)
        for option, (path, kind) in outputs.items()
        if path
    }
    for option, (
        path,
        _,
    ) in given.items():  # the inputs first: a refusal names what the user would lose
        _check_place(option, path)
        for what, shown, where in found:
            _check_apart(option, path, _real(path), what, shown, where, places, "input")
    for option, (path, _) in given.items():
        for other, (shown, _) in given.items():
            if other != option:
                _check_apart(option, path, _real(path), other, shown, _real(shown), [], "output")
    for option, (path, kind) in given.items():
        _check_kind(option, path, kind, replace_flag)


def _check_place(option: str, path: Path) -> None:
    hint = f"pass {option} a path of a new file or folder (to throw the result away, write it to a temporary folder)"
    if special := special_kind(path):
        raise ConfigError(
            f"{option} {path} is {special}, not a file or folder spec_cli can write", hint
        )
    real = _real(path)
    if _within(real, Path("/dev")):
        raise ConfigError(
            f"{option} {path} is in the system's device folder {real.parts[0]}{real.parts[1]}", hint
        )
    if real == _real(Path.home()) or real.parent == real:
        raise ConfigError(
            f"{option} {path} is the {'home' if real.parent != real else 'root'} folder",
            f"pass {option} a new folder",
        )


def _check_apart(option, path, real, what, shown, where, places, source) -> None:
    """`path` (at `real`) is not `what`'s path `shown` (at `where`), not inside it, and does not hold it."""
    if real == where:
        relation = "is"
    elif _within(real, where) and not any(_within(real, place) for place in places):
        relation = "is inside"
    elif _within(where, real):
        relation = "holds"
    else:
        return
    whose = what if what.startswith("the ") else f"this command's {source} {what}"
    raise ConfigError(
        f"{option} {path} {relation} {whose} {shown}; nothing was written",
        f"pass another {option}: a command never writes over, into or around its own "
        f"{source}s" + ("" if source == "output" else " (or the built-in assets)"),
    )


def _check_kind(option: str, path: Path, kind: Kind, replace_flag: str | None) -> None:
    if not path.exists():
        return
    if kind.folder:
        if not path.is_dir():
            raise ConfigError(
                f"{option} {path} is {what_is(path)}; {kind.name} is a folder",
                f"pass {option} a folder path that does not exist yet",
            )
        if _empty(path) or kind.ours(path):
            return
    else:
        if path.is_dir():
            raise ConfigError(
                f"{option} {path} is a folder ({what_is(path)}); {kind.name} is one file",
                f"pass {option} a file path inside it or elsewhere",
            )
        if kind.ours(path):
            return
    flag = (
        f" ({replace_flag} replaces only {kind.name} that spec_cli wrote)" if replace_flag else ""
    )
    raise ConfigError(
        f"{option} {path} is {what_is(path)}, not {kind.name}; it is never replaced",
        f"pass another {option}{flag}",
    )
