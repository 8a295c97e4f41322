"""`spec train`'s option groups: each option declared once, flat names both ways, the CLI made from them."""

import dataclasses
import typing
from pathlib import Path

import pytest
import typer.main

from spec_cli.cli import build_app
from spec_cli.draft.algorithm import ObjectiveOptions
from spec_cli.stages.train_options import (OPTIONS, RESUMABLE, ObjectiveFlags, TrainConfig, parse_duration,
                                           parse_size)


def test_sizes_and_durations_parse_as_a_user_writes_them():
    assert [parse_size(t, "-x") for t in ("512M", "4G", "4GiB", "1.5k", "65536")] == [
        512 << 20, 4 << 30, 4 << 30, 1536, 65536]
    assert [parse_duration(t, "-x") for t in ("90s", "45m", "2h", "1.5")] == [90.0, 2700.0, 7200.0, 90.0]


def test_the_objective_flags_are_the_algorithms_options():
    flags, options = dataclasses.fields(ObjectiveFlags), dataclasses.fields(ObjectiveOptions)
    assert [(f.name, f.default) for f in flags] == [(f.name, f.default) for f in options]
    assert typing.get_type_hints(ObjectiveFlags) == typing.get_type_hints(ObjectiveOptions)


def test_flat_options_build_the_groups_and_come_back_flat():
    cfg = TrainConfig.from_options(vocab_map=Path("vm"), output=Path("run"), lr=3e-3, ttt_steps=3, pack=True,
                                   stream=True, fc_norm=True)
    assert (cfg.optim.lr, cfg.objective.ttt_steps, cfg.data.pack, cfg.runtime.stream, cfg.draft.fc_norm) == \
        (3e-3, 3, True, True, True)
    assert isinstance(cfg.objective, ObjectiveOptions)  # what algorithm.objective takes
    flat = cfg.options()
    assert list(flat) == list(OPTIONS) and TrainConfig.from_options(**flat) == cfg
    assert flat["epochs"] == 1.0 and flat["stream_max_bytes"] == 4 << 30  # the rest keep their defaults
    with pytest.raises(TypeError, match="no option learning_rate"):
        TrainConfig.from_options(vocab_map="vm", output="run", learning_rate=1)
    with pytest.raises(TypeError):  # the one without a default (--vocab-map is checked by the stage:
        TrainConfig.from_options(vocab_map="vm")  # a --resume takes the run's own)


def test_the_train_command_has_one_option_per_field():
    command = typer.main.get_command(build_app()).commands["train"]
    assert [p.name for p in command.params] == [*OPTIONS, "config", "quiet"]
    by_name = {p.name: p for p in command.params}
    assert by_name["stream_max_bytes"].default == "4G"  # parsed to bytes (parse_size) by the command
    assert by_name["init_from_target"].secondary_opts == ["--random-init"]
    assert by_name["output"].required  # and --vocab-map, but for --resume: the stage checks it
    assert not by_name["vocab_map"].required and by_name["vocab_map"].default is None
    assert RESUMABLE == {"max_steps", "epochs", "save_every", "keep_last", "log_every", "eval_every", "resume",
                         "device", "num_proc", "activation_checkpointing", "remote", "prefetch", "token",
                         "max_time", "stream", "stream_max_bytes", "stream_dir", "init_from_target", "fsdp",
                         "target_engine", "peagle_segments"}
