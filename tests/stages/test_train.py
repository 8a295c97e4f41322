"""spec train: exact resume, cache == live, checkpoints and logs. (DDP and FSDP2 == one process:
tests/test_distributed.py; `spec serve-target` + `spec train --remote` == live: tests/stages/test_kills.py.)"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from spec_cli.stages import train as stage


@pytest.fixture(scope="module")
def setup(train_setup):
    """A peaked tiny Llama target, chat data, vocab map and a feature cache (tests/conftest.py)."""
    return train_setup


def config(setup, out, **kw) -> stage.TrainConfig:
    base = dict(
        vocab_map=setup["vm"],
        output=out,
        cache=setup["cache"],
        ttt_steps=3,
        lr=3e-3,
        max_steps=6,
        log_every=2,
        eval_every=3,
        save_every=3,
        eval_fraction=0.2,
        batch_tokens=512,
    )
    base.update(kw)
    return stage.TrainConfig.from_options(**base)


def frozen_lr(cfg: stage.TrainConfig) -> stage.TrainConfig:
    """`cfg` with lr 0 (the weights stay the initial ones): past --lr's check (> 0), for tests only."""
    import dataclasses

    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.0))


def weights(run_dir: Path) -> dict:
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "model.safetensors"))


def assert_same(a: dict, b: dict, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def test_resume_continues_bit_for_bit(setup, tmp_path):
    straight = stage.run(config(setup, tmp_path / "straight"))
    assert straight.steps == 6

    def interrupt(step):
        if step == 4:  # after a checkpoint at 3: Ctrl-C saves step 4 too
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stage.run(config(setup, tmp_path / "resumed"), after_step=interrupt)
    assert ckpt.latest_checkpoint(tmp_path / "resumed").name == "step-00000004"
    resumed = stage.run(config(setup, tmp_path / "resumed", resume=True))
    assert resumed.steps == 6
    assert_same(weights(tmp_path / "straight"), weights(tmp_path / "resumed"))
    opt_a = load_file(str(ckpt.latest_checkpoint(tmp_path / "straight") / "optimizer.safetensors"))
    opt_b = load_file(str(ckpt.latest_checkpoint(tmp_path / "resumed") / "optimizer.safetensors"))
    assert_same(opt_a, opt_b)


def test_checkpoints_logs_and_plot(setup, tmp_path):
    out = tmp_path / "run"
    result = stage.run(config(setup, out, max_steps=8, save_every=2, keep_last=2))
    assert [p.name for p in ckpt.checkpoint_dirs(out)] == ["step-00000006", "step-00000008"]
    last = ckpt.latest_checkpoint(out)
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["total_steps"] == 8
    model = load_file(str(last / "model.safetensors"))
    for key in [
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    ]:
        assert key in model, key
    assert "embed_tokens.weight" not in model  # frozen: once per run, in frozen.safetensors
    assert model["lm_head.weight"].shape[0] == 96 and model["t2d"].dtype == torch.bool
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6, 8] and [r["step"] for r in evals] == [3, 6, 8]
    assert len(train[0]["acc"]) == 3 and train[0]["tokens_per_s"] > 0
    assert (
        0 < train[0]["peak_memory_gb"] < 64
    )  # this process's peak RSS on CPU (GPU: the allocator's peak)
    assert result.plot is not None and result.plot.stat().st_size > 10_000


def test_checkpoints_leave_the_frozen_embedding_to_one_file_per_run(setup, tmp_path):
    """Every checkpoint used to repeat the frozen [V, H] table (671 MB for Gemma 3); now the run keeps
    it once, in frozen.safetensors as the target holds it, and readers put it back."""
    from spec_cli.artifacts.feature_cache import FeatureCacheReader
    from spec_cli.draft.config import DraftConfig
    from spec_cli.draft.eagle3.model import Eagle3Draft
    from spec_cli.export.source import load_source

    out = tmp_path / "run"
    stage.run(config(setup, out, max_steps=4, save_every=2, eval_every=0))
    dirs = ckpt.checkpoint_dirs(out)
    assert [d.name for d in dirs] == ["step-00000002", "step-00000004"]
    embed = FeatureCacheReader(setup["cache"]).head()[0]["embed_tokens"]  # the target's table
    frozen = load_file(str(out / ckpt.FROZEN))
    assert frozen.keys() == {"embed_tokens.weight"} and torch.equal(
        frozen["embed_tokens.weight"], embed
    )
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors") == [ckpt.FROZEN]
    embed_bytes = embed.numel() * 4  # the draft's fp32 copy, which each checkpoint used to hold
    for d in dirs:
        model = load_file(str(d / "model.safetensors"))
        with torch.device("meta"):
            draft = Eagle3Draft(DraftConfig.from_dict(json.loads((d / "config.json").read_text())))
        assert set(model) == set(draft.state_dict()) - {"embed_tokens.weight"}
        tensor_bytes = sum(t.numel() * t.element_size() for t in model.values())
        size = (d / "model.safetensors").stat().st_size
        assert tensor_bytes <= size < tensor_bytes + 8192 < tensor_bytes + embed_bytes
        assert ckpt.checkpoint_meta(d)["frozen"] == {
            "keys": ["embed_tokens.weight"],
            "file": ckpt.FROZEN,
            "fingerprint": ckpt.frozen_meta(out / ckpt.FROZEN)["fingerprint"],
        }
    # export and eval read the whole draft back, embedding included
    src = load_source(out)
    assert torch.equal(src.state["embed_tokens.weight"].float(), embed.float())


def test_each_rank_resumes_its_own_gpus_generator_from_rank_0s(monkeypatch):
    """CUDA emulated (the generator calls recorded): rank 0 saves the generator of the GPU it trains on;
    on resume every rank puts it into its own GPU's generator (the ranks draw alike, so rank r's cuda:r
    stands where rank 0's cuda:0 stood), also from checkpoints that kept every visible GPU's state."""
    from spec_cli.trainer.checkpoints import _restore_rng, _rng_state

    calls = []
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state",
        lambda device: (
            calls.append(("get", device)) or torch.tensor([7, int(device.index)], dtype=torch.uint8)
        ),
    )
    monkeypatch.setattr(
        torch.cuda,
        "set_rng_state",
        lambda state, device: calls.append(("set", state.tolist(), device)),
    )
    saved = _rng_state(torch.device("cuda", 0))
    assert calls == [("get", torch.device("cuda", 0))] and saved["torch_cuda"].tolist() == [7, 0]
    calls.clear()
    _restore_rng(saved, torch.device("cuda", 3))
    assert calls == [("set", [7, 0], torch.device("cuda", 3))]
    calls.clear()
    older = {
        "torch_cpu": torch.get_rng_state(),
        **{f"torch_cuda_{i}": torch.tensor([i], dtype=torch.uint8) for i in range(12)},
    }
    _restore_rng(older, torch.device("cuda", 2))
    assert calls == [
        ("set", [0], torch.device("cuda", 2))
    ]  # rank 0's own (cuda:0), not cuda:2's or cuda:10's
    calls.clear()
    assert set(_rng_state(torch.device("cpu"))) == {"torch_cpu"}
    _restore_rng(saved, torch.device("cpu"))
    assert calls == []


def test_resume_refuses_another_embedding_and_continues_old_checkpoints(
    setup, tmp_path, monkeypatch
):
    """A checkpoint written before frozen.safetensors (the table inside) resumes bit for bit; a resume
    whose target hands another table than the one the run trained with is refused."""
    from safetensors.torch import save_file

    from spec_cli.artifacts.feature_cache import FeatureCacheReader
    from spec_cli.errors import ArtifactError
    from spec_cli.targets.cache_backend import CacheBackend

    straight = stage.run(config(setup, tmp_path / "straight", max_steps=5, eval_every=0))
    old = tmp_path / "old"

    def interrupt(step):
        if step == 3:
            raise KeyboardInterrupt  # saves step 3

    with pytest.raises(KeyboardInterrupt):
        stage.run(config(setup, old, max_steps=5, eval_every=0), after_step=interrupt)
    latest = ckpt.latest_checkpoint(
        old
    )  # rewrite it as an old checkpoint: embedding in model.safetensors
    model = load_file(str(latest / "model.safetensors"))
    model["embed_tokens.weight"] = (
        FeatureCacheReader(setup["cache"]).head()[0]["embed_tokens"].float()
    )
    meta = {"spec_cli": json.dumps({"kind": "draft_checkpoint", "schema_version": 1, "step": 3})}
    save_file(model, str(latest / "model.safetensors"), metadata=meta)
    (old / ckpt.FROZEN).unlink()
    assert (
        straight.steps
        == stage.run(config(setup, old, max_steps=5, eval_every=0, resume=True)).steps
        == 5
    )
    assert_same(weights(tmp_path / "straight"), weights(old))
    assert (old / ckpt.FROZEN).is_file() and "embed_tokens.weight" not in weights(old)

    real = CacheBackend.get_input_embeddings
    monkeypatch.setattr(CacheBackend, "get_input_embeddings", lambda self: real(self) * 2)
    with pytest.raises(ArtifactError, match="different input embedding"):
        stage.run(config(setup, tmp_path / "straight", max_steps=5, eval_every=0, resume=True))


def test_resume_refuses_changed_options_and_new_runs_refuse_old_folders(setup, tmp_path, capsys):
    out = tmp_path / "run"
    stage.run(config(setup, out, max_steps=3))
    args = [
        "train",
        "--cache",
        str(setup["cache"]),
        "-v",
        str(setup["vm"]),
        "-o",
        str(out),
        "--ttt-steps",
        "3",
        "--lr",
        "3e-3",
        "--max-steps",
        "6",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "-q",
    ]
    assert main(args) == 1
    assert "already holds checkpoints" in capsys.readouterr().err
    assert main(args + ["--resume", "--ttt-steps", "4"]) == 1
    assert "different ttt-steps" in capsys.readouterr().err


def test_training_from_cache_equals_training_live(setup, tmp_path):
    """Same batches, bit-identical supervision: the same weights either way."""
    cached = stage.run(config(setup, tmp_path / "cached", max_steps=4))
    live = stage.run(
        config(
            setup,
            tmp_path / "live",
            max_steps=4,
            cache=None,
            target=str(setup["target"]),
            data=str(setup["data"]),
            dtype="fp32",
        )
    )
    assert cached.steps == live.steps == 4
    assert_same(weights(tmp_path / "cached"), weights(tmp_path / "live"))


def test_it_learns(setup, tmp_path):
    stage.run(config(setup, tmp_path / "learn", max_steps=40, eval_every=40, log_every=5))
    records = [
        json.loads(line) for line in (tmp_path / "learn" / "log.jsonl").read_text().splitlines()
    ]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert train[-1]["loss"] < 0.8 * train[0]["loss"]
    assert evals[-1]["loss"] < 0.8 * train[0]["loss"]  # and on held-out batches
    assert train[-1]["acc"][0] > train[0]["acc"][0]


def test_max_time_stops_with_a_checkpoint_and_resume_finishes_the_schedule(setup, tmp_path, capsys):
    args = [
        "train",
        "-v",
        str(setup["vm"]),
        "--cache",
        str(setup["cache"]),
        "--ttt-steps",
        "3",
        "--lr",
        "3e-3",
        "--max-steps",
        "5",
        "--eval-fraction",
        "0.2",
        "--batch-tokens",
        "512",
        "-q",
    ]
    assert main(args + ["-o", str(tmp_path / "straight")]) == 0
    # a limit already reached after the first step: the run stops there, checkpoint saved
    assert main(args + ["-o", str(tmp_path / "timed"), "--max-time", "0.001s"]) == 0
    assert ckpt.latest_checkpoint(tmp_path / "timed").name == "step-00000001"
    state = json.loads(
        (ckpt.latest_checkpoint(tmp_path / "timed") / "trainer_state.json").read_text()
    )
    assert state["total_steps"] == 5
    assert main(args + ["-o", str(tmp_path / "timed"), "--resume"]) == 0
    assert ckpt.latest_checkpoint(tmp_path / "timed").name == "step-00000005"
    assert_same(weights(tmp_path / "straight"), weights(tmp_path / "timed"))

    capsys.readouterr()
    assert main(args + ["-o", str(tmp_path / "bad"), "--max-time", "soon"]) == 1
    err = capsys.readouterr().err
    assert "--max-time 'soon' is not a duration" in err and "45m" in err


def test_init_from_target_copies_the_targets_head_and_random_init_does_not(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    from spec_cli.artifacts.vocab_map import load_vocab_map

    target = AutoModelForCausalLM.from_pretrained(str(setup["target"]))
    ids = load_vocab_map(setup["vm"]).selected_token_ids
    # lr 0: the saved weights are the initial ones (from the cache, as from a live target)
    for source in (
        {"cache": setup["cache"]},
        {"cache": None, "target": str(setup["target"]), "data": str(setup["data"])},
    ):
        out = tmp_path / f"init-{len(source)}"
        stage.run(frozen_lr(config(setup, out, max_steps=1, init_from_target=True, **source)))
        w = weights(out)
        assert torch.equal(w["lm_head.weight"], target.lm_head.weight[ids].detach())
        torch.testing.assert_close(w["norm.weight"], target.model.norm.weight.detach())
    stage.run(frozen_lr(config(setup, tmp_path / "random", max_steps=1)))  # the default
    w = weights(tmp_path / "random")
    assert not torch.equal(w["lm_head.weight"], target.lm_head.weight[ids].detach())
    assert torch.equal(w["norm.weight"], torch.ones_like(w["norm.weight"]))


def test_init_layer_from_target_starts_the_layer_from_the_target_after_its_last_aux_layer(
    setup, tmp_path
):
    """--init-layer-from-target, from a feature cache (the target folder it names) and from a live target:
    the first layer's target-shaped weights are the target's layer after the highest aux layer (8 layers:
    aux 1, 3, 4, so layer 5) and fc passes aux state 4 through."""
    from spec_cli.targets import loading

    layer = loading.read_decoder_layer(setup["target"], 5)
    for source in (
        {"cache": setup["cache"]},
        {"cache": None, "target": str(setup["target"]), "data": str(setup["data"])},
    ):
        out = tmp_path / f"layer-{len(source)}"
        stage.run(frozen_lr(config(setup, out, max_steps=1, init_layer_from_target=True, **source)))
        w = weights(out)
        H = w["midlayer.hidden_norm.weight"].shape[0]
        assert torch.equal(w["midlayer.mlp.down_proj.weight"], layer["mlp.down_proj.weight"])
        assert torch.equal(
            w["midlayer.self_attn.q_proj.weight"][:, H:], layer["self_attn.q_proj.weight"]
        )
        assert torch.equal(w["midlayer.hidden_norm.weight"], layer["input_layernorm.weight"])
        assert torch.equal(w["fc.weight"], torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], dim=1))


def test_a_cache_made_with_another_vocab_map_names_that_map(setup, tmp_path, capsys):
    other = tmp_path / "vm-64.safetensors"
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(setup["target"]),
                "-d",
                str(setup["data"]),
                "--draft-vocab-size",
                "64",
                "-o",
                str(other),
                "-q",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--cache",
                str(setup["cache"]),
                "-v",
                str(other),
                "-o",
                str(tmp_path / "run"),
                "--max-steps",
                "1",
                "-q",
            ]
        )
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert f"the vocab map {other}" in err
    assert (
        f"made with ({setup['vm'].resolve()})" in err
        and "--vocab-map used for `spec precompute`" in err
    )
    assert not (tmp_path / "run").exists()


def test_the_recipe_levers_through_the_cli_resume_bit_for_bit_and_export(setup, tmp_path, capsys):
    """--optimizer muon --schedule wsd --hidden-noise: a run stopped at step 4 and resumed equals the straight
    run (Muon's momentum and AdamW's moments in the checkpoint, the noise's RNG restored); the noise
    changes training; the export's self-check passes and its config carries none of it."""
    levers = [
        "--optimizer",
        "muon",
        "--muon-lr",
        "6e-3",
        "--schedule",
        "wsd",
        "--decay-ratio",
        "0.5",
        "--hidden-noise",
        "0.05",
    ]

    def args(out, *extra):
        return [
            "train",
            "--cache",
            str(setup["cache"]),
            "-v",
            str(setup["vm"]),
            "-o",
            str(out),
            "--ttt-steps",
            "3",
            "--lr",
            "3e-3",
            "--max-steps",
            "6",
            "--batch-tokens",
            "512",
            "--eval-fraction",
            "0.2",
            "--eval-every",
            "3",
            "--save-every",
            "3",
            "--log-every",
            "1",
            "-q",
            *extra,
        ]

    assert main(args(tmp_path / "straight", *levers)) == 0
    state = json.loads(
        (ckpt.latest_checkpoint(tmp_path / "straight") / "trainer_state.json").read_text()
    )
    muon, adamw = state["param_groups"]
    assert "fc.weight" in muon["params"] and muon["lr_scale"] == pytest.approx(2.0)
    assert {"lm_head.weight", "norm.weight"} <= set(adamw["params"])
    opt = load_file(str(ckpt.latest_checkpoint(tmp_path / "straight") / "optimizer.safetensors"))
    assert "state.fc.weight.momentum_buffer" in opt and "state.lm_head.weight.exp_avg" in opt
    lrs = [
        r["lr"]
        for r in map(json.loads, (tmp_path / "straight" / "log.jsonl").read_text().splitlines())
        if r.get("split") == "train"
    ]
    assert lrs == pytest.approx(
        [3e-3, 3e-3, 3e-3, 2e-3, 1e-3, 0.0]
    )  # flat, then a linear decay over 3 steps

    def interrupt(step):
        if step == 4:
            raise KeyboardInterrupt

    cfg = stage.TrainConfig.from_options(
        vocab_map=setup["vm"],
        output=tmp_path / "resumed",
        cache=setup["cache"],
        ttt_steps=3,
        lr=3e-3,
        max_steps=6,
        batch_tokens=512,
        eval_fraction=0.2,
        eval_every=3,
        save_every=3,
        log_every=1,
        optimizer="muon",
        muon_lr=6e-3,
        schedule="wsd",
        decay_ratio=0.5,
        hidden_noise=0.05,
    )
    with pytest.raises(KeyboardInterrupt):
        stage.run(cfg, after_step=interrupt)
    assert main(args(tmp_path / "resumed", "--resume")) == 0
    assert_same(weights(tmp_path / "straight"), weights(tmp_path / "resumed"))
    assert_same(
        opt, load_file(str(ckpt.latest_checkpoint(tmp_path / "resumed") / "optimizer.safetensors"))
    )

    assert main(args(tmp_path / "quiet", *levers[:-2])) == 0  # the same without the noise
    assert not torch.equal(
        weights(tmp_path / "quiet")["fc.weight"], weights(tmp_path / "straight")["fc.weight"]
    )

    out = tmp_path / "export"
    assert (
        main(["export", str(tmp_path / "straight"), "-f", "vllm", "-o", str(out), "-q"]) == 0
    )  # self-checked
    config_text = (out / "config.json").read_text()
    assert "noise" not in config_text and "muon" not in config_text
