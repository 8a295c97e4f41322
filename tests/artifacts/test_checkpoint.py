"""Draft checkpoints: the round trip (weights, optimizer, RNG, config, trainer state), which checkpoint
is the latest, what a save killed midway leaves, keep_last, and the frozen weights kept once per run."""

import shutil

import pytest
import torch

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.errors import ArtifactError


def save(run_dir, step, **kw):
    model = {"fc.weight": torch.full((2, 3), float(step)), "d2t": torch.arange(4)}
    return ckpt.save_checkpoint(
        run_dir,
        step,
        model,
        {},
        {"torch_cpu": torch.get_rng_state()},
        {"hidden_size": 2},
        {"step": step},
        **kw,
    )


def test_round_trip_of_everything_a_resume_needs(tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    names = [name for name, _ in layer.named_parameters()]
    opt_tensors, groups = ckpt.flatten_optimizer(opt.state_dict(), names)
    rng = {"torch_cpu": torch.get_rng_state()}
    path = ckpt.save_checkpoint(
        tmp_path,
        7,
        layer.state_dict(),
        opt_tensors,
        rng,
        {"hidden_size": 2},
        {"step": 7, "epoch": 0, "param_groups": groups},
    )
    assert path == tmp_path / "checkpoints" / "step-00000007"
    parts = ckpt.load_checkpoint(path)
    assert parts["config"] == {"hidden_size": 2}
    assert parts["trainer_state"]["step"] == 7 and parts["trainer_state"]["schema_version"] == 1
    assert parts["frozen_keys"] == []
    for name, value in layer.state_dict().items():
        assert torch.equal(parts["model"][name], value)
    assert torch.equal(parts["rng"]["torch_cpu"], rng["torch_cpu"])

    # the optimizer restored from the file takes the same next step as the one that was saved
    copy = torch.nn.Linear(3, 2)
    copy.load_state_dict(parts["model"])
    opt_copy = torch.optim.AdamW(copy.parameters(), lr=0.1)
    opt_copy.load_state_dict(
        ckpt.unflatten_optimizer(parts["optimizer"], parts["trainer_state"]["param_groups"], names)
    )
    x = torch.randn(4, 3)
    for model, optimizer in ((layer, opt), (copy, opt_copy)):
        model(x).sum().backward()
        optimizer.step()
    for a, b in zip(layer.parameters(), copy.parameters()):
        assert torch.equal(a, b)


def test_latest_is_the_highest_step_and_partial_folders_are_ignored(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    for step in (20, 100, 3):
        save(tmp_path, step)
    folder = tmp_path / "checkpoints"
    partial = (
        folder / ".step-00000500.x1y2.tmp"
    )  # a save killed mid-write (SIGKILL: nothing cleaned up)
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    (folder / "step-600").mkdir()  # not a name spec train writes
    (folder / "step-00000700.json").write_text("{}")
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == [
        "step-00000003",
        "step-00000020",
        "step-00000100",
    ]
    assert ckpt.latest_checkpoint(tmp_path) == folder / "step-00000100"
    assert ckpt.resolve_checkpoint(tmp_path) == folder / "step-00000100"
    assert ckpt.resolve_checkpoint(folder / "step-00000020") == folder / "step-00000020"
    with pytest.raises(ArtifactError, match="holds no draft checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "empty")


def test_a_save_that_fails_midway_keeps_the_previous_checkpoints(tmp_path, monkeypatch):
    save(tmp_path, 10)
    real_save_file = ckpt.save_file

    def fail_on_rng(tensors, filename, metadata=None):
        if filename.endswith("rng.safetensors"):
            raise OSError("disk full")
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", fail_on_rng)
    with pytest.raises(OSError):
        save(tmp_path, 20)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000010"]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["trainer_state"]["step"] == 10


def test_keep_last_deletes_the_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep_last=2)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["step-00000003", "step-00000004"]


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path):
    path = save(tmp_path, 1)
    (path / "config.json").unlink()
    with pytest.raises(ArtifactError, match="cannot read the checkpoint"):
        ckpt.load_checkpoint(path)


def test_the_fingerprint_is_the_same_for_a_bf16_table_and_its_fp32_copy():
    table = torch.randn(5, 4).bfloat16()
    assert ckpt.frozen_fingerprint({"e": table}) == ckpt.frozen_fingerprint({"e": table.float()})
    changed = table.clone()
    changed[0, 0] += 1
    assert ckpt.frozen_fingerprint({"e": table}) != ckpt.frozen_fingerprint({"e": changed})
    assert ckpt.frozen_fingerprint({"e": table}) != ckpt.frozen_fingerprint({"f": table})


def test_frozen_weights_are_found_in_the_run_and_checked_by_fingerprint(tmp_path):
    embed = {"embed_tokens.weight": torch.randn(6, 2).bfloat16()}
    fingerprint = ckpt.frozen_fingerprint(embed)
    run = tmp_path / "run"
    run.mkdir()
    ckpt.save_frozen(run, embed, fingerprint, {})
    frozen = {"keys": ["embed_tokens.weight"], "fingerprint": fingerprint}
    path = save(run, 5, frozen=frozen)
    assert "embed_tokens.weight" not in ckpt.load_checkpoint(path)["model"]
    assert ckpt.load_checkpoint(path)["frozen_keys"] == ["embed_tokens.weight"]
    got = ckpt.load_frozen(path)
    assert torch.equal(got["embed_tokens.weight"], embed["embed_tokens.weight"])

    moved = shutil.copytree(
        path, tmp_path / "moved"
    )  # out of its run folder: the file is not found
    with pytest.raises(ArtifactError, match="frozen.safetensors") as err:
        ckpt.load_frozen(moved)
    assert "copy the run's frozen.safetensors" in err.value.hint
    assert ckpt.load_frozen(moved, required=False) == {}
    other = {"embed_tokens.weight": torch.zeros(6, 2)}  # another run's table beside it is refused
    ckpt.save_frozen(moved, other, ckpt.frozen_fingerprint(other), {})
    with pytest.raises(ArtifactError, match=f"fingerprint {fingerprint}"):
        ckpt.load_frozen(moved)
    with pytest.raises(ValueError, match="also in model_state"):
        ckpt.save_checkpoint(
            run, 6, {"embed_tokens.weight": torch.ones(1)}, {}, {}, {}, {}, frozen=frozen
        )


def test_a_resumed_run_removes_what_a_killed_one_left_half_written(tmp_path):
    """What SIGKILL leaves mid-write (atomic writes' temporaries, a checkpoint folder being replaced)
    goes when the next run holds the folder; finished files and anything else stay."""
    from spec_cli.artifacts.checkpoint import remove_temporaries

    (tmp_path / "run.json").write_text("{}")
    (tmp_path / ".run.json.oyc4pbr7.tmp").write_text("{")
    (tmp_path / ".frozen.safetensors.5yxh4t0y.tmp").write_bytes(b"\0")
    (tmp_path / ".tmpaMo6FA").write_bytes(
        b"\0"
    )  # safetensors' own temporary (its save_file writes through one)
    (tmp_path / ".notes").write_text("the user's")
    checkpoints = tmp_path / "checkpoints"
    for name in (
        "step-00000002",
        ".step-00000004.ab_cd123.tmp",
        ".step-00000002.old",
        ".step-00000006.shards.tmp",
    ):  # (the last: FSDP2 ranks' shards, the folder unfinished)
        (checkpoints / name).mkdir(parents=True)
    assert remove_temporaries(tmp_path) == [
        ".frozen.safetensors.5yxh4t0y.tmp",
        ".run.json.oyc4pbr7.tmp",
        ".tmpaMo6FA",
        ".step-00000002.old",
        ".step-00000004.ab_cd123.tmp",
        ".step-00000006.shards.tmp",
    ]
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        ".notes",
        "checkpoints",
        "run.json",
        "step-00000002",
    ]


def test_a_safetensors_file_cut_short_or_grown_is_named_with_its_sizes(tmp_path):
    """The damage a reader names: the file's size against 8 + header + the data the header lays out."""
    model = save(tmp_path, 1) / "model.safetensors"
    data = model.read_bytes()
    header = int.from_bytes(data[:8], "little")
    end = 8 + header + 6 * 4 + 4 * 8  # fc.weight: 2x3 fp32; d2t: 4 int64
    assert len(data) == end and ckpt.safetensors_damage(model) is None
    model.write_bytes(data[: end - 5])
    assert (
        ckpt.safetensors_damage(model)
        == f"model.safetensors is cut short ({end - 5:,} of {end:,} bytes)"
    )
    model.write_bytes(data[:100])
    assert (
        ckpt.safetensors_damage(model)
        == f"model.safetensors is cut short (100 bytes; its header alone takes {8 + header:,})"
    )
    model.write_bytes(data + b"\0")
    assert ckpt.safetensors_damage(model) == (
        f"model.safetensors is longer than its header says ({end + 1:,} bytes, {end:,} expected)"
    )
    assert ckpt.checkpoint_damage(model.parent) == ckpt.safetensors_damage(model)
    model.write_bytes(data)
    (model.parent / "rng.safetensors").write_bytes(b"")  # read only for a resume
    assert ckpt.checkpoint_damage(model.parent) is None
    assert (
        ckpt.checkpoint_damage(model.parent, resume=True)
        == "rng.safetensors is cut short (0 bytes, less than a header)"
    )
