"""The real CLI: help, config files, the error table, build-vocab-map end to end on tiny targets."""

import os
import random
import subprocess
import sys

import pytest

from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.cli import main
from tests import tiny
from tests.conftest import write_jsonl

STAGES = [
    "assets",
    "regenerate",
    "build-vocab-map",
    "precompute",
    "train",
    "export",
    "eval",
    "serve-target",
    "inspect",
    "demo",
]


def spec(*args, env=None):
    """Run the installed console script as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "spec_cli.cli", *args], capture_output=True, text=True, env=full_env
    )


@pytest.mark.slow
def test_help_lists_every_stage_and_each_stage_documents_defaults():
    out = spec("--help")
    assert out.returncode == 0
    for stage in STAGES:
        assert stage in out.stdout
    out = spec("build-vocab-map", "--help")
    assert out.returncode == 0
    for option in [
        "--target",
        "--data",
        "--output",
        "--draft-vocab-size",
        "--max-length",
        "--num-proc",
        "--config",
        "--quiet",
    ]:
        assert option in out.stdout
    assert "default: 32000" in out.stdout and "default: 2048" in out.stdout


def test_the_cli_imports_no_torch():
    """`spec --help` stays fast: the commands import their stage (and torch) only when they run."""
    code = (
        "import sys, typer.main; from spec_cli.cli import build_app; typer.main.get_command(build_app()); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'datasets')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_main_builds_train_from_the_options_declared_when_it_runs(monkeypatch, capsys):
    """An option declared after import (a draft algorithm registered later) is a flag of the next main()."""
    import inspect
    from typing import Annotated

    import typer

    from spec_cli.commands import train

    declared = train.parameters
    knob = inspect.Parameter(
        "knob",
        inspect.Parameter.KEYWORD_ONLY,
        default=3,
        annotation=Annotated[int, typer.Option("--knob", help="A late option.")],
    )
    monkeypatch.setattr(train, "parameters", lambda: [*declared(), knob])
    assert main(["train", "--help"]) == 0
    assert "--knob" in capsys.readouterr().out
    monkeypatch.setattr(train, "parameters", declared)
    assert main(["train", "--help"]) == 0
    assert "--knob" not in capsys.readouterr().out


@pytest.fixture
def data_file(tmp_path):
    rng = random.Random(0)
    return write_jsonl(tmp_path / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(30)])


@pytest.mark.slow
def test_version_and_usage_errors_are_what_a_user_expects(capsys):
    out = spec("--version")  # the console script
    assert out.returncode == 0 and out.stdout.strip().startswith("spec_cli ")
    # a value of the wrong type, a missing option, an unknown command: click's usage message and exit 2,
    # never an "internal error"
    cases = [
        (("train", "-v", "x", "-o", "y", "--ttt-steps", "many"), "Invalid value for '--ttt-steps'"),
        (("train",), "Missing option '--output'"),
        (("nosuch",), "No such command 'nosuch'"),
        (
            ("train", "-v", "x", "-o", "y", "--max-time", "soon"),
            "--max-time 'soon' is not a duration",
        ),
        (
            ("train", "-v", "x", "-o", "y", "--stream-max-bytes", "lots"),
            "--stream-max-bytes 'lots' is not a size",
        ),
    ]
    for args, message in cases:
        code = main(list(args))
        err = capsys.readouterr().err
        assert message in " ".join(err.split()), (args, err)
        assert "internal error" not in err
        assert code == (1 if "is not a" in message else 2)


def test_build_vocab_map_cli(tiny_tokenizer_dirs, data_file, tmp_path, capsys):
    out = tmp_path / "vm.safetensors"
    code = main(
        [
            "build-vocab-map",
            "--target",
            str(tiny_tokenizer_dirs["llama3"]),
            "--data",
            str(data_file),
            "--draft-vocab-size",
            "64",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    vm = load_vocab_map(out)
    assert vm.draft_vocab_size == 64 and vm.target_vocab_size == 400
    printed = capsys.readouterr().out
    assert "coverage" in printed and "30 records" in printed
    # inspect shows the same artifact
    assert main(["inspect", str(out)]) == 0
    assert "vocab_map" in capsys.readouterr().out


def test_config_file_supplies_options_and_flags_win(tiny_tokenizer_dirs, data_file, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"target: {tiny_tokenizer_dirs['chatml']}\ndata: {data_file}\n"
        f"draft-vocab-size: 32\noutput: {tmp_path / 'from_file.safetensors'}\n"
    )
    assert main(["build-vocab-map", "--config", str(cfg), "-q"]) == 0
    assert load_vocab_map(tmp_path / "from_file.safetensors").draft_vocab_size == 32
    assert (
        main(
            [
                "build-vocab-map",
                "--config",
                str(cfg),
                "--draft-vocab-size",
                "48",
                "-o",
                str(tmp_path / "flag.safetensors"),
                "-q",
            ]
        )
        == 0
    )
    assert load_vocab_map(tmp_path / "flag.safetensors").draft_vocab_size == 48


@pytest.mark.slow
def test_unknown_config_key_is_an_error_naming_it(tmp_path, data_file):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("target: x\ndraft_vocab: 12\n")
    out = spec("build-vocab-map", "--config", str(cfg), "--data", str(data_file), "-o", "x")
    assert out.returncode == 1
    assert "unknown key 'draft_vocab'" in out.stderr
    assert "draft-vocab-size" in out.stderr  # says what is accepted
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_user_errors_are_one_line_with_traceback_only_in_debug(
    tiny_tokenizer_dirs, data_file, tmp_path, capfd
):
    args = [
        "build-vocab-map",
        "-t",
        str(tiny_tokenizer_dirs["chatml"]),
        "-d",
        str(data_file),
        "--draft-vocab-size",
        "100000",
        "-o",
        str(tmp_path / "v.safetensors"),
    ]
    assert main(args) == 1  # in process: everything written to the stderr descriptor is captured
    err = capfd.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "larger than the target vocab (400)" in lines[0] and "use at most 400" in lines[0]
    assert not (tmp_path / "v.safetensors").exists()
    debug = spec(*args, env={"SPEC_DEBUG": "1"})  # the console script, as a user runs it
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_missing_data_and_bad_target_errors(tiny_tokenizer_dirs, tmp_path, capsys):
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(tiny_tokenizer_dirs["chatml"]),
                "-d",
                str(tmp_path / "no.jsonl"),
                "--draft-vocab-size",
                "10",
                "-o",
                str(tmp_path / "v.safetensors"),
            ]
        )
        == 1
    )
    assert "data not found" in capsys.readouterr().err
    assert (
        main(["build-vocab-map", "-t", str(tmp_path / "nomodel"), "-d", "x.jsonl", "-o", "v"]) == 1
    )
    assert "does not exist" in capsys.readouterr().err


def test_no_supervised_tokens_is_an_error(tiny_tokenizer_dirs, tmp_path, capsys):
    data = write_jsonl(
        tmp_path / "q.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}] * 3
    )
    code = main(
        [
            "build-vocab-map",
            "-t",
            str(tiny_tokenizer_dirs["chatml"]),
            "-d",
            str(data),
            "--draft-vocab-size",
            "10",
            "-o",
            str(tmp_path / "v.safetensors"),
        ]
    )
    assert code == 1
    assert "no usable records" in capsys.readouterr().err


@pytest.mark.slow
def test_unreadable_data_is_one_line_with_the_parsers_reason(tiny_tokenizer_dirs, tmp_path):
    """datasets/pyarrow printed their own error line before ours; the cause belongs in ours."""
    bad = tmp_path / "bad.json"
    bad.write_text("not json at all {\n")
    out = spec(
        "build-vocab-map",
        "-t",
        str(tiny_tokenizer_dirs["chatml"]),
        "-d",
        str(bad),
        "--draft-vocab-size",
        "64",
        "-o",
        str(tmp_path / "v.safetensors"),
    )
    assert out.returncode == 1
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: cannot read") and "JSON parse error" in " ".join(
        out.stderr.split()
    )
