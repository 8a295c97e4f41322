"""What the algorithms' CLI pipeline tests read of a run and do to an export."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

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


@contextlib.contextmanager
def own_home(root):
    """SPEC_HOME = root/home while a fixture runs the CLI (tokenised data goes there)."""
    import pytest

    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        yield
    finally:
        mp.undo()


def vocab_and_cache(
    root,
    target,
    data,
    vocab_size: int = 64,
    *precompute_extra: str,
    vm: str = "vm.safetensors",
    cache: str = "cache",
) -> tuple:
    """`spec build-vocab-map` + `spec precompute` of `data` for `target` into root/`vm` and root/`cache`
    (SPEC_HOME root/home): the inputs most CLI tests start from. -> (vocab map, cache)."""
    from spec_cli.cli import main

    vm, cache = root / vm, root / cache
    with own_home(root):
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "--draft-vocab-size",
                    str(vocab_size),
                    "-o",
                    str(vm),
                    "-q",
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "precompute",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "-v",
                    str(vm),
                    "-o",
                    str(cache),
                    "-q",
                    *precompute_extra,
                ]
            )
            == 0
        )
    return vm, cache


def peagle_train_args(root, vm, out, *extra) -> list[str]:
    """`spec train --algorithm peagle` from root/cache: the P-EAGLE pipeline's run, 4 steps."""
    return [
        "train",
        "--cache",
        str(root / "cache"),
        "-v",
        str(vm),
        "--algorithm",
        "peagle",
        "--ttt-steps",
        "4",
        "--lr",
        "3e-3",
        "--max-steps",
        "4",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--save-every",
        "4",
        "-o",
        str(out),
        "-q",
        *extra,
    ]


def dflash_train_args(root, vm, out, *extra) -> list[str]:
    """`spec train --algorithm dflash` from root/cache: the DFlash pipeline's run, 4 steps, blocks of 4."""
    return [
        "train",
        "--cache",
        str(root / "cache"),
        "-v",
        str(vm),
        "--algorithm",
        "dflash",
        "--block-size",
        "4",
        "--draft-layers",
        "2",
        "--lr",
        "3e-3",
        "--max-steps",
        "4",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--save-every",
        "4",
        "-o",
        str(out),
        "-q",
        *extra,
    ]


def pipeline(root, target, algorithm: str) -> dict:
    """build-vocab-map -> precompute --algorithm A -> a short `spec train --algorithm A` (root/run) on 12
    chats, through the CLI, for EAGLE-1/2 (`eagle`: two draft layers) or P-EAGLE (`peagle`: two
    segments); 2 more chats as eval prompts. (SPEC_HOME root/home.)"""
    import json
    import random

    from spec_cli.cli import main
    from tests import tiny
    from tests.conftest import write_jsonl

    V = json.loads((target / "config.json").read_text())["vocab_size"]
    rng = random.Random({"eagle": 3, "peagle": 5, "dflash": 9}[algorithm])
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(12)])
    prompts = write_jsonl(root / "prompts.jsonl", [tiny.random_sharegpt(rng) for _ in range(2)])
    vm = str(
        vocab_and_cache(
            root,
            target,
            data,
            V if algorithm == "eagle" else 96,
            "--algorithm",
            algorithm,
            "--batch-tokens",
            "512",
        )[0]
    )
    with own_home(root):
        if algorithm == "eagle":
            assert (
                main(
                    [
                        "train",
                        "--cache",
                        str(root / "cache"),
                        "-v",
                        vm,
                        "--algorithm",
                        "eagle",
                        "--ttt-steps",
                        "2",
                        "--max-steps",
                        "4",
                        "--lr",
                        "3e-3",
                        "--batch-tokens",
                        "512",
                        "--eval-fraction",
                        "0.2",
                        "--save-every",
                        "4",
                        "--draft-layers",
                        "2",
                        "-o",
                        str(root / "run"),
                        "-q",
                    ]
                )
                == 0
            )
        elif algorithm == "dflash":
            assert main(dflash_train_args(root, vm, root / "run")) == 0
        else:
            assert main(peagle_train_args(root, vm, root / "run", "--peagle-segments", "2")) == 0
    return {"root": root, "target": target, "data": data, "prompts": prompts, "vm": vm, "V": V}


def context_parallel_commands(runs: dict[str, list], common: list, folder: Path) -> list[list]:
    """The torchrun x2 --context-parallel 2 command of each of `runs` (name -> its source options), with
    `common`, writing folder/cp-NAME: for one launch (tests/launch.py), with other commands if need be."""
    return [
        ["train", *source, "-o", str(folder / f"cp-{name}"), "--context-parallel", "2", *common]
        for name, source in runs.items()
    ]


def context_parallel_equals_one_process(
    runs: dict[str, list],
    common: list,
    folder: Path,
    atol: float = 1e-5,
    also: list = (),
    launched: bool = False,
) -> None:
    """Each of `runs` (name -> its source options) trained under torchrun x2 with --context-parallel 2 and
    in one process, both with `common`: the same weights (fp32 rounding: the attention is summed in other
    pieces, and Adam divides a tiny gradient's rounding by its tiny RMS: `atol` of weights moved by a few
    steps at lr 3e-3) and the same logged training losses and token counts. `also`: more commands for
    the same launch (after the runs), whose results the caller checks; `launched`: the caller's launch
    ran context_parallel_commands already."""
    import pytest
    import torch

    from spec_cli.cli import main
    from tests.launch import torchrun

    if not launched:
        torchrun(context_parallel_commands(runs, common, folder) + list(also), folder / "launch")
    for name, source in runs.items():
        assert main(["train", *source, "-o", str(folder / f"one-{name}"), *common]) == 0
        one, cp = weights(folder / f"one-{name}"), weights(folder / f"cp-{name}")
        for key, value in one.items():
            torch.testing.assert_close(cp[key], value, rtol=1e-4, atol=atol, msg=f"{name}: {key}")
        train = [
            [r for r in log(folder / f"{kind}-{name}") if r["split"] == "train"]
            for kind in ("one", "cp")
        ]
        assert [r["step"] for r in train[0]] == [r["step"] for r in train[1]] and train[0]
        for a, b in zip(*train):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["tokens"] == a["tokens"]
