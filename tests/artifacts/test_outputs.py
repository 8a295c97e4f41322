"""Nothing a user gives a command is ever replaced (spec_cli.artifacts.outputs).

The walk: every command's every input option, with its output pointed at that input, inside it and at the
folder holding it, with and without the command's replace flag. Each is refused in one line that names the
input, exit 1, and a checksum of the whole tree is the same before and after.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from pathlib import Path

import pytest

from spec_cli.artifacts import outputs
from spec_cli.cli import main
from tests import tiny
from tests.conftest import write_jsonl
from tests.draft.runs import own_home, vocab_and_cache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tree(tmp_path_factory, tiny_llama_dir):
    """Every kind of input a command reads, each in a folder of its own: a model, chat data, a chat
    template, a vocab map, a feature cache, a training run and an export."""
    root = tmp_path_factory.mktemp("outputs")
    model = Path(shutil.copytree(tiny_llama_dir, root / "model"))
    (root / "data").mkdir()
    data = write_jsonl(
        root / "data" / "chat.jsonl", [tiny.random_sharegpt(random.Random(i)) for i in range(6)]
    )
    (root / "template").mkdir()
    template = root / "template" / "chat.jinja"
    from transformers import AutoTokenizer

    template.write_text(AutoTokenizer.from_pretrained(model).chat_template)
    (root / "maps").mkdir()
    vm, cache = vocab_and_cache(root, model, data, 64, vm="maps/vm.safetensors")
    with own_home(root):
        assert (
            main(
                [
                    "train",
                    "-v",
                    str(vm),
                    "--cache",
                    str(cache),
                    "-o",
                    str(root / "run"),
                    "--max-steps",
                    "1",
                    "--eval-fraction",
                    "0",
                    "--ttt-steps",
                    "1",
                    "-q",
                ]
            )
            == 0
        )
        assert (
            main(
                ["export", str(root / "run"), "--format", "vllm", "-o", str(root / "export"), "-q"]
            )
            == 0
        )
    shutil.rmtree(root / "home")
    return {
        "root": root,
        "model": model,
        "data": data,
        "template": template,
        "vm": vm,
        "cache": cache,
        "run": root / "run",
        "export": root / "export",
    }


def checksum(root: Path) -> str:
    """Every path under `root` with its contents (files) or kind (folders, links)."""
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        digest.update(f"D {os.path.relpath(folder, root)}\n".encode())
        for name in sorted(files):
            path = Path(folder) / name
            digest.update(f"F {os.path.relpath(path, root)} ".encode())
            digest.update(
                path.read_bytes() if not path.is_symlink() else os.readlink(path).encode()
            )
    return digest.hexdigest()


# command -> (its arguments with OUT where the output goes, {input option: the tree's key}, replace flags)
COMMANDS = {
    "build-vocab-map": (
        [
            "build-vocab-map",
            "-t",
            "{model}",
            "-d",
            "{data}",
            "--chat-template",
            "{template}",
            "--draft-vocab-size",
            "32",
            "-o",
            "OUT",
        ],
        {"--target": "model", "--data": "data", "--chat-template": "template"},
        ["--force"],
    ),
    "regenerate": (
        [
            "regenerate",
            "-t",
            "{model}",
            "-d",
            "{data}",
            "--chat-template",
            "{template}",
            "--max-new-tokens",
            "2",
            "-o",
            "OUT",
        ],
        {"--target": "model", "--data": "data", "--chat-template": "template"},
        ["--overwrite"],
    ),
    "regenerate --features": (
        [
            "regenerate",
            "-t",
            "{model}",
            "-d",
            "{data}",
            "-o",
            "{root}/new/regen.jsonl",
            "--engine",
            "vllm",
            "-v",
            "{vm}",
            "--features",
            "OUT",
        ],
        {"--target": "model", "--data": "data", "--vocab-map": "vm"},
        ["--overwrite"],
    ),
    "precompute": (
        [
            "precompute",
            "-t",
            "{model}",
            "-d",
            "{data}",
            "-v",
            "{vm}",
            "--chat-template",
            "{template}",
            "-o",
            "OUT",
        ],
        {"--target": "model", "--data": "data", "--vocab-map": "vm", "--chat-template": "template"},
        ["--no-resume"],
    ),
    "train (cache)": (
        ["train", "-v", "{vm}", "--cache", "{cache}", "--max-steps", "1", "-o", "OUT"],
        {"--vocab-map": "vm", "--cache": "cache"},
        ["--resume"],
    ),
    "train (live)": (
        [
            "train",
            "-v",
            "{vm}",
            "-t",
            "{model}",
            "-d",
            "{data}",
            "--chat-template",
            "{template}",
            "--max-steps",
            "1",
            "-o",
            "OUT",
        ],
        {"--target": "model", "--data": "data", "--chat-template": "template"},
        ["--resume"],
    ),
    "export": (
        ["export", "{run}", "--format", "vllm", "-t", "{model}", "-o", "OUT"],
        {"the source": "run", "--target": "model"},
        ["--overwrite"],
    ),
    "eval": (
        [
            "eval",
            "--draft",
            "{run}",
            "-t",
            "{model}",
            "-p",
            "{data}",
            "--chat-template",
            "{template}",
            "--max-new-tokens",
            "2",
            "-o",
            "OUT",
        ],
        {"--draft": "run", "--target": "model", "--prompts": "data", "--chat-template": "template"},
        [],
    ),
    "tune": (
        ["tune", "{export}", "-t", "{model}", "-p", "{data}", "--engine", "torch", "-o", "OUT"],
        {"the draft": "export", "--target": "model", "--prompts": "data"},
        [],
    ),
    "plan": (["plan", "{model}", "--json", "OUT"], {"the target": "model"}, []),
}
PLACES = ("the input", "inside it", "its folder")
CASES = [
    (command, option, place, flag)
    for command, (_, inputs, flags) in COMMANDS.items()
    for option in inputs
    for place in PLACES
    for flag in [None, *flags]
]


def where(tree: dict, key: str, place: str) -> Path:
    given = tree[key]
    return {"the input": given, "inside it": given / "out", "its folder": given.parent}[place]


@pytest.mark.parametrize(
    "command,option,place,flag",
    CASES,
    ids=[f"{c}:{o}:{p.replace(' ', '-')}:{f or 'plain'}" for c, o, p, f in CASES],
)
def test_an_output_at_an_input_is_refused_and_nothing_changes(
    tree, command, option, place, flag, capsys
):
    args, inputs, _ = COMMANDS[command]
    out = where(tree, inputs[option], place)
    argv = [a.replace("OUT", str(out)).format(**{k: str(v) for k, v in tree.items()}) for a in args]
    before = checksum(tree["root"])
    with own_home(tree["root"] / "scratch"):
        code = main(argv + ([flag] if flag else []) + ["-q"] * (command != "plan"))
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert "\n" not in err and "internal error" not in err, err
    named = [f"{option} {tree[inputs[option]]}"]
    if out == tree["root"]:  # the folder that holds every input: any of them is named
        named = [f"{o} {tree[key]}" for o, key in inputs.items()]
    assert any(n in err for n in named) and "nothing was written" in err, err
    shutil.rmtree(
        tree["root"] / "scratch", ignore_errors=True
    )  # the command's own tokenisation cache, if any
    assert checksum(tree["root"]) == before


@pytest.mark.parametrize(
    "command,kind",
    [
        ("build-vocab-map", "a file spec_cli did not write"),
        ("precompute", "a folder holding files spec_cli did not write"),
        ("eval", "a folder holding files spec_cli did not write"),
    ],
)
def test_a_users_files_are_never_replaced_even_with_the_replace_flag(
    tree, tmp_path, command, kind, capsys
):
    """Outside every input: a file or folder of the user's at -o is refused, with --force/--overwrite too."""
    mine = tmp_path / "mine"
    if command == "build-vocab-map":
        mine.write_text("notes")
        argv = [
            "build-vocab-map",
            "-t",
            str(tree["model"]),
            "-d",
            str(tree["data"]),
            "-o",
            str(mine),
            "--force",
        ]
    else:
        mine.mkdir()
        (mine / "eval.json").write_text('{"my": "numbers"}')
        argv = (
            [
                "precompute",
                "-t",
                str(tree["model"]),
                "-d",
                str(tree["data"]),
                "-v",
                str(tree["vm"]),
                "-o",
                str(mine),
                "--no-resume",
            ]
            if command == "precompute"
            else ["eval", "--draft", str(tree["run"]), "-t", str(tree["model"]), "-o", str(mine)]
        )
    before = checksum(tmp_path)
    assert main(argv + ["-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert f"-o {mine} is {kind}" in err and "never replaced" in err, err
    assert checksum(tmp_path) == before


@pytest.mark.parametrize(
    "command", ["build-vocab-map", "regenerate", "precompute", "train", "export", "eval", "demo"]
)
def test_a_device_is_refused_before_any_work(tree, tmp_path, command, capsys):
    """-o /dev/null (with the replace flags too): refused at once, no work folder left beside it."""
    root, null = tree["root"], "/dev/null"
    argv = {
        "build-vocab-map": [
            "build-vocab-map",
            "-t",
            str(tree["model"]),
            "-d",
            str(tree["data"]),
            "--force",
        ],
        "regenerate": [
            "regenerate",
            "-t",
            str(tree["model"]),
            "-d",
            str(tree["data"]),
            "--overwrite",
        ],
        "precompute": [
            "precompute",
            "-t",
            str(tree["model"]),
            "-d",
            str(tree["data"]),
            "-v",
            str(tree["vm"]),
        ],
        "train": [
            "train",
            "-v",
            str(tree["vm"]),
            "--cache",
            str(tree["cache"]),
            "--max-steps",
            "1",
        ],
        "export": ["export", str(root / "run"), "--format", "vllm", "--overwrite"],
        "eval": ["eval", "--draft", str(root / "run"), "-t", str(tree["model"])],
        "demo": ["demo", "--quick", "--no-install"],
    }[command]
    before = set(os.listdir("/dev"))
    assert main(argv + ["-o", null, "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: -o {null} is a character device") and "\n" not in err, err
    assert (
        "--force" not in err and "--overwrite" not in err
    )  # no hint that leads to another refusal
    assert set(os.listdir("/dev")) == before


def test_eval_keeps_its_results_in_the_runs_eval_folder(tree, tmp_path):
    """RUN/eval is the run's own place for evaluations: inside the input --draft, and allowed."""
    run = tree["run"]
    outputs.check(
        {"-o": (run / "eval" / "mine", outputs.EVAL)}, {"--draft": run}, own_places=[run / "eval"]
    )
    with pytest.raises(Exception, match="is inside this command's input --draft"):
        outputs.check(
            {"-o": (run / "checkpoints" / "x", outputs.EVAL)},
            {"--draft": run},
            own_places=[run / "eval"],
        )


def test_two_outputs_of_one_command_are_apart(tree, tmp_path, capsys):
    """spec regenerate's -o and --features: one may not hold the other."""
    argv = [
        "regenerate",
        "-t",
        str(tree["model"]),
        "-d",
        str(tree["data"]),
        "-o",
        str(tmp_path / "f" / "out.jsonl"),
        "--engine",
        "vllm",
        "-v",
        str(tree["vm"]),
        "--features",
        str(tmp_path / "f"),
        "-q",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "is inside this command's output --features" in err, err
    assert not (tmp_path / "f").exists()
