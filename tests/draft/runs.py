"""What the algorithms' CLI pipeline tests read of a run and do to an export."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file


def log(run) -> list[dict]:
    """The run's log.jsonl records."""
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def weights(run) -> dict:
    """The latest checkpoint's model.safetensors."""
    return load_file(str(sorted((run / "checkpoints").iterdir())[-1] / "model.safetensors"))


def tampered(exports, tmp_path, fmt, edit_tensors=None, edit_config=None):
    """A copy of the `fmt` export with its tensors and/or config.json edited in place."""
    folder = tmp_path / fmt
    shutil.copytree(exports / fmt, folder)
    if edit_tensors:
        tensors = load_file(str(folder / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def vocab_and_cache(root, target, data, vocab_size: int = 64, *precompute_extra: str) -> tuple:
    """`spec build-vocab-map` + `spec precompute` of `data` for `target` into root/vm.safetensors and
    root/cache (SPEC_HOME root/home): the inputs most CLI tests start from. -> (vocab map, cache)."""
    import pytest

    from spec_cli.cli import main

    vm, cache = root / "vm.safetensors", root / "cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert main(["build-vocab-map", "-t", str(target), "-d", str(data), "--draft-vocab-size", str(vocab_size),
                     "-o", str(vm), "-q"]) == 0
        assert main(["precompute", "-t", str(target), "-d", str(data), "-v", str(vm), "-o", str(cache), "-q",
                     *precompute_extra]) == 0
    finally:
        mp.undo()
    return vm, cache
