"""`--help` at 80 columns: every option of every command in full, in panels, flags without a type."""

import re

import pytest
import typer.main

from spec_cli.cli import build_app, main


def _commands():
    group = typer.main.get_command(build_app())
    return group, sorted(group.commands)


def _help_at_80(monkeypatch, capsys, argv) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("TERMINAL_WIDTH", "80")  # what typer's own renderer would read
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", [None, *_commands()[1]])
def test_help_at_80_columns_shows_every_option_whole(name, monkeypatch, capsys):
    group, _ = _commands()
    command = group if name is None else group.commands[name]
    out = _help_at_80(monkeypatch, capsys, [] if name is None else [name])
    assert "…" not in out  # nothing cut: names, values and help all wrap instead
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80
    assert not re.search(r"<bool>|BOOLEAN", out), "a flag takes no value: no type marker"
    assert len(re.findall(r"\[default: [^\]\n]+\]", out)) == out.count(
        "[default:"
    )  # each on one line
    names = ["-h", "--help"] + [
        n
        for p in command.params
        for n in (*p.opts, *p.secondary_opts)
        if p.param_type_name == "option"
    ]
    for option in names:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", out), (name, option)


def test_commands_with_many_options_group_them_into_panels(monkeypatch, capsys):
    out = _help_at_80(monkeypatch, capsys, ["train"])
    panels = re.findall(r"╭─ (.+?) ─", out)
    assert panels == [
        "Inputs and output",
        "Live target",
        "Data",
        "Draft",
        "Objective",
        "Optimisation",
        "Checkpoints & logging",
        "Engine in the loop",
        "Runtime",
        "Options",
    ]
    for name in ("precompute", "regenerate", "eval", "serve-target", "export"):
        assert len(re.findall(r"╭─ ", _help_at_80(monkeypatch, capsys, [name]))) >= 3, name


def test_help_says_what_an_option_takes_and_its_default(monkeypatch, capsys):
    out = _help_at_80(monkeypatch, capsys, ["train"])
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out).split())  # the help column's lines joined
    assert re.search(r"--lr FLOAT +Peak learning rate", out)
    assert re.search(r"--vocab-map, -v PATH", out) and re.search(r"--fsdp +Under torchrun", out)
    assert "[default: --random-init]" in flat and "[env var: SPEC_SERVE_TOKEN]" in flat
    assert "[default: 8192]" in flat and "[required]" in flat
