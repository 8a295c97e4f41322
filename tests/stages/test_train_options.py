"""`spec train`'s option groups: each option declared once (the objective's by ObjectiveFlags and by each
algorithm's package), flat names both ways, the CLI made from them."""

import dataclasses
import typing
from pathlib import Path

import pytest
import typer.main

from spec_cli.cli import build_app
from spec_cli.draft import algorithms
from spec_cli.draft.dflash import DFlashOptions
from spec_cli.draft.dspark import DSparkOptions
from spec_cli.draft.eagle import EagleOptions
from spec_cli.draft.msd import MsdOptions
from spec_cli.draft.peagle import PEagleOptions
from spec_cli.train_options import (
    ObjectiveFlags,
    ObjectiveOptions,
    TrainConfig,
    all_options,
    parse_duration,
    parse_size,
    parse_size_or_auto,
    resumable_options,
    typed_options,
)


def test_sizes_and_durations_parse_as_a_user_writes_them():
    assert [parse_size(t, "-x") for t in ("512M", "4G", "4GiB", "1.5k", "65536")] == [
        512 << 20,
        4 << 30,
        4 << 30,
        1536,
        65536,
    ]
    assert [parse_size_or_auto(t, "-x") for t in ("auto", " Auto ", "4G")] == [None, None, 4 << 30]
    assert [parse_duration(t, "-x") for t in ("90s", "45m", "2h", "1.5")] == [
        90.0,
        2700.0,
        7200.0,
        90.0,
    ]


def test_the_objective_group_is_the_shared_flags_then_each_algorithms_own():
    declared = [
        f.name
        for kind in (
            ObjectiveFlags,
            EagleOptions,
            PEagleOptions,
            DFlashOptions,
            DSparkOptions,
            MsdOptions,
        )
        for f in dataclasses.fields(kind)
    ]
    assert [o.name for o in all_options().values() if o.group == "objective"] == declared
    assert declared == [
        "ttt_steps",
        "step_weight",
        "hidden_noise",
        "loss",
        "lk_kl_scale",
        "lk_kl_decay",
        "feature_weight",
        "token_weight",
        "cod_ratio",
        "cod_min",
        "peagle_segments",
        "block_size",
        "block_decay",
        "max_anchors",
        "markov_rank",
        "confidence_head",
        "confidence_with_markov",
        "ce_weight",
        "l1_weight",
        "confidence_weight",
        "text_steps",
        "multimodal_ratio",
        "multimodal_ramp_steps",
    ]
    assert [a.options for a in algorithms.ALGORITHMS.values()] == [
        None,
        EagleOptions,
        PEagleOptions,
        DFlashOptions,
        DSparkOptions,
        MsdOptions,
    ]
    assert typing.get_type_hints(PEagleOptions)["peagle_segments"] is int
    defaults = ObjectiveOptions()
    assert (defaults.ttt_steps, defaults.token_weight, defaults.cod_ratio) == (3, 0.1, 0.7)
    assert (
        ObjectiveOptions(cod_ratio=0.5) != defaults and ObjectiveOptions(cod_ratio=0.7) == defaults
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.ttt_steps = 3
    with pytest.raises(TypeError, match="no option medusa_heads"):
        ObjectiveOptions(medusa_heads=4)


@dataclasses.dataclass(frozen=True)
class _Own:
    own_weight: float = dataclasses.field(
        default=0.5, metadata={"flag": None, "resumable": False, "allowed": None}
    )


def test_an_algorithm_registered_later_brings_its_options(monkeypatch):
    plus = dataclasses.replace(algorithms.ALGORITHMS["eagle3"], name="plus", options=_Own)
    monkeypatch.setitem(algorithms.ALGORITHMS, "plus", plus)
    assert (
        list(all_options())[list(all_options()).index("multimodal_ramp_steps") + 1] == "own_weight"
    )
    cfg = TrainConfig.from_options(vocab_map="vm", output="run", own_weight=0.25)
    assert cfg.objective.own_weight == 0.25 and cfg.options()["own_weight"] == 0.25


def test_flat_options_build_the_groups_and_come_back_flat():
    cfg = TrainConfig.from_options(
        vocab_map=Path("vm"),
        output=Path("run"),
        lr=3e-3,
        ttt_steps=3,
        pack=True,
        stream=True,
        fc_norm=True,
    )
    assert (
        cfg.optim.lr,
        cfg.objective.ttt_steps,
        cfg.data.pack,
        cfg.runtime.stream,
        cfg.draft.fc_norm,
    ) == (3e-3, 3, True, True, True)
    assert isinstance(cfg.objective, ObjectiveOptions)  # what algorithm.objective takes
    flat = cfg.options()
    assert list(flat) == list(all_options()) and TrainConfig.from_options(**flat) == cfg
    assert (
        flat["epochs"] == 1.0 and flat["stream_max_bytes"] is None
    )  # the rest keep their defaults
    with pytest.raises(TypeError, match="no option learning_rate"):
        TrainConfig.from_options(vocab_map="vm", output="run", learning_rate=1)
    with pytest.raises(
        TypeError
    ):  # the one without a default (--vocab-map is checked by the stage:
        TrainConfig.from_options(vocab_map="vm")  # a --resume takes the run's own)


def test_the_train_command_has_one_option_per_field():
    command = typer.main.get_command(build_app()).commands["train"]
    assert [p.name for p in command.params] == [*all_options(), "config", "quiet"]
    by_name = {p.name: p for p in command.params}
    assert (
        by_name["stream_max_bytes"].default == "auto"
    )  # parsed (parse_size_or_auto: None) by the command
    assert by_name["init_from_target"].secondary_opts == ["--random-init"]
    assert by_name["output"].required  # and --vocab-map, but for --resume: the stage checks it
    assert not by_name["vocab_map"].required and by_name["vocab_map"].default is None
    assert resumable_options() == {
        "max_steps",
        "epochs",
        "save_every",
        "keep_last",
        "log_every",
        "eval_every",
        "resume",
        "save_every_minutes",
        "stop_grace",
        "reschedule",
        "device",
        "num_proc",
        "activation_checkpointing",
        "remote",
        "prefetch",
        "token",
        "max_time",
        "stream",
        "stream_max_bytes",
        "stream_dir",
        "init_from_target",
        "init_layer_from_target",
        "fsdp",
        "tensor_plane",
        "target_engine",
        "target_parallel",
        "target_memory",
        "target_tensor_parallel",
        "attention",
        "precision",
        "peagle_segments",
        "eval_engine",
        "eval_engine_every",
        "eval_engine_wait",
        "eval_engine_target",
        "eval_engine_memory",
    }


def _train_config(monkeypatch, tmp_path, *args) -> TrainConfig:
    """The config `spec train ARGS` trains with once a --resume has read its run.json (the command and
    trainer.resume as the CLI runs them; nothing is trained)."""
    import types

    from typer.testing import CliRunner

    import spec_cli.ui
    from spec_cli.stages import train as stage
    from spec_cli.trainer import resume

    seen = []

    def run(cfg):
        seen.append(resume.resumed_config(cfg, typed_options()))
        return types.SimpleNamespace(stream=None)

    monkeypatch.setattr(stage, "run", run)
    monkeypatch.setattr(spec_cli.ui, "print_train_summary", lambda result: None)
    result = CliRunner().invoke(build_app(), ["train", "-v", str(tmp_path / "vm"), *args])
    assert result.exit_code == 0, result.output
    return seen[0]


def test_each_algorithm_trains_at_its_own_defaults_and_a_typed_value_wins(monkeypatch, tmp_path):
    run = str(tmp_path / "run")
    trained = {
        name: _train_config(monkeypatch, tmp_path, "-o", run, "--algorithm", name)
        for name in algorithms.ALGORITHMS
    }
    got = {name: (c.objective.ttt_steps, c.optim.lr) for name, c in trained.items()}
    # EAGLE-3 (the default): TTT 3 at lr 1e-3 (docs/peers.md); EAGLE-1/2, MSD (its objective) and
    # P-EAGLE unroll 7; DFlash and DSpark read no TTT depth (their block is theirs)
    assert got == {
        "eagle3": (3, 1e-3),
        "eagle": (7, 2e-4),
        "peagle": (7, 2e-4),
        "dflash": (3, 2e-4),
        "dspark": (3, 2e-4),
        "msd": (7, 2e-4),
    }
    assert _train_config(monkeypatch, tmp_path, "-o", run) == trained["eagle3"]
    typed = _train_config(
        monkeypatch,
        tmp_path,
        "-o",
        run,
        "--algorithm",
        "peagle",
        "--ttt-steps",
        "3",
        "--lr",
        "1e-3",
    )
    assert (typed.objective.ttt_steps, typed.optim.lr) == (3, 1e-3)
    config = tmp_path / "config.yaml"  # a --config file's value is typed too
    config.write_text("algorithm: eagle\nttt_steps: 2\n")
    from_file = _train_config(monkeypatch, tmp_path, "-o", run, "--config", str(config))
    assert (from_file.objective.ttt_steps, from_file.optim.lr) == (2, 2e-4)
    # the API builds the same configs
    api = TrainConfig.from_options(vocab_map=tmp_path / "vm", output=Path(run), algorithm="peagle")
    assert api == trained["peagle"]


def test_a_resumed_run_keeps_the_defaults_it_was_started_with(monkeypatch, tmp_path):
    """A run started before EAGLE-3's defaults moved (run.json: TTT 7, lr 2e-4), or a P-EAGLE run
    resumed without retyping --algorithm, continues with its own values, not today's defaults."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    for algorithm in ("eagle3", "peagle"):
        recorded = TrainConfig.from_options(
            vocab_map=str(tmp_path / "vm"),
            output=str(run),
            algorithm=algorithm,
            ttt_steps=7,
            lr=2e-4,
        ).options()
        (run / "run.json").write_text(
            json.dumps({"options": recorded, "identity": {}}, default=str)
        )
        cfg = _train_config(monkeypatch, tmp_path, "-o", str(run), "--resume")
        assert (cfg.draft.algorithm, cfg.objective.ttt_steps, cfg.optim.lr) == (algorithm, 7, 2e-4)
        typed = _train_config(monkeypatch, tmp_path, "-o", str(run), "--resume", "--lr", "1e-3")
        assert typed.optim.lr == 1e-3  # (a typed value is checked against run.json by the trainer)
