"""vLLM in the loop (the `vllm` extra): `spec eval --engine vllm`, the export's engine check, and engine
resources released on exit, error and Ctrl-C. The tiny target is sized for vLLM's CPU attention
(head_dim 32: the CPU kernels take 32, 64, 80, ... only); its draft is trained here so that it accepts
something, which the acceptance comparisons need."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_cli.cli import main
from tests import tiny
from tests.tiny import save_vllm_sized_target  # noqa: F401 (the other engine tests import it from here)

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine


def train_on_sized_target(
    root: Path, *train_args: str, target: Path | None = None, draft_vocab: int = 64
) -> dict:
    """A peaked vLLM-sized target (or `target`), 80 random chats, a `draft_vocab`-token vocab map and a draft
    trained on them live (`spec train` with these extra options) into ROOT/run, with SPEC_HOME under `root`."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        target = target or tiny.peaked_copy(save_vllm_sized_target(root / "raw"), root / "target")
        rng = random.Random(0)
        data = root / "data.jsonl"
        data.write_text("".join(json.dumps(tiny.random_sharegpt(rng)) + "\n" for _ in range(80)))
        vm = str(root / "vm.safetensors")
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "--draft-vocab-size",
                    str(draft_vocab),
                    "-o",
                    vm,
                    "-q",
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "train",
                    "--target",
                    str(target),
                    "--data",
                    str(data),
                    "-v",
                    vm,
                    "-o",
                    str(root / "run"),
                    "--lr",
                    "1e-2",
                    "--batch-tokens",
                    "512",
                    "-q",
                    *train_args,
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    return {"root": root, "target": target, "data": data, "run": root / "run"}


def served_as_checked(capsys, least_same: int) -> tuple[str, list[int]]:
    """The engine check's summary (`spec export --engine-check vllm` printed it): vLLM accepted what the
    checkpoint accepts per position, and proposed the same draft tokens at `least_same`% of > 10 steps or
    more. Returns (the printed text, the accepted counts per position)."""
    text = " ".join(capsys.readouterr().out.split())
    assert "engine check passed: vLLM" in text
    served, reference = re.search(
        r"accepted per position (\[[\d, ]+\]) vs (\[[\d, ]+\])", text
    ).groups()
    assert served == reference and json.loads(served)[0] > 0
    same = re.search(r"same draft tokens at (\d+)% of (\d+) steps", text)
    assert int(same.group(1)) >= least_same and int(same.group(2)) > 10
    return text, json.loads(served)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A peaked tiny target, a draft trained on it for 150 steps (after 100 it barely reads its
    aux layers: the wrong-aux export below proposes the same tokens), and its vLLM export, written
    as a user without SPEC_ENGINE_CHECK writes it (auto: vLLM is here, so its engine check runs),
    with the printed summary kept for test_export_engine_check_passes_and_reports_vllms_numbers."""
    run = train_on_sized_target(
        tmp_path_factory.mktemp("engine"), "--ttt-steps", "2", "--max-steps", "150"
    )
    root = run["root"]
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    mp.setenv("SPEC_ENGINE_CHECK", "auto")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = main(
                ["export", str(root / "run"), "--format", "vllm", "--dtype", "fp32", "-o"]
                + [str(root / "export")]
            )
        assert code == 0, printed.getvalue()
    finally:
        mp.undo()
    return {**run, "export": root / "export", "export_printed": printed.getvalue()}


def _eval(trained, draft, out: Path, *extra: str) -> dict:
    assert (
        main(
            [
                "eval",
                "-t",
                str(trained["target"]),
                "--draft",
                str(draft),
                "--prompts",
                str(trained["data"]),
                "--num-prompts",
                "3",
                "--max-new-tokens",
                "16",
                "-o",
                str(out),
                "-q",
                *extra,
            ]
        )
        == 0
    )
    return json.loads((out / "eval.json").read_text())


@pytest.fixture(scope="module")
def torch_eval(trained, tmp_path_factory) -> tuple[dict, Path]:
    """The PyTorch evaluator on the trained run (its fp32 exports decode the same): (eval.json, folder)."""
    out = tmp_path_factory.mktemp("torch-eval") / "torch"
    return _eval(trained, trained["run"], out), out


@pytest.mark.slow
def test_vllm_eval_counts_equal_the_pytorch_evaluator(trained, torch_eval, tmp_path):
    torch_report, torch_dir = torch_eval
    vllm_report = _eval(trained, trained["run"], tmp_path / "vllm", "--engine", "vllm")
    t, v = torch_report["overall"], vllm_report["overall"]
    assert sum(t["accepted"]) > 0, (
        "the draft must accept something for the comparison to mean anything"
    )
    assert v["accepted"] == t["accepted"] and v["verified"] == t["verified"]
    assert v["acceptance_length"] == pytest.approx(t["acceptance_length"])
    assert v["acceptance_rate"] == t["acceptance_rate"]
    assert (
        v["same_as_target"] == v["turns"] == t["turns"]
    )  # vLLM's speculative output == its target alone
    assert v["spec_tokens_per_s"] > 0 and v["target_tokens_per_s"] > 0 and v["speedup"] > 0
    assert vllm_report["engine"]["name"] == "vllm" and vllm_report["engine"]["load_problems"] == []
    assert vllm_report["settings"]["engine"] == "vllm"
    records = [
        json.loads(line) for line in (tmp_path / "vllm" / "outputs.jsonl").read_text().splitlines()
    ]
    ours = [json.loads(line) for line in (torch_dir / "outputs.jsonl").read_text().splitlines()]
    assert [r["accepted_per_step"] for r in records] == [r["accepted_per_step"] for r in ours]
    assert all(r["spec_seconds"] > 0 and r["target_seconds"] > 0 for r in records)
    assert (tmp_path / "vllm" / "acceptance.png").stat().st_size > 0


def _accepted_per_step(folder: Path) -> list[int]:
    """Drafts accepted at each verify step of every turn (outputs.jsonl)."""
    return [
        m
        for line in (folder / "outputs.jsonl").read_text().splitlines()
        for m in json.loads(line)["accepted_per_step"]
    ]


def _mean_and_se(xs: list[int]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    return mean, (sum((x - mean) ** 2 for x in xs) / (n - 1) / n) ** 0.5


@pytest.mark.slow
def test_sampled_acceptance_agrees_with_vllm_under_the_same_rule(trained, tmp_path):
    """At temperature 0.7 vLLM drafts the argmax and accepts it with probability p_target(token)
    (draft_sample_method greedy); spec eval's default does the same. Over ~500 verify steps each, the
    acceptance lengths and each position's acceptance rate agree within 3 standard errors of their
    difference, computed from the counts. vLLM's CPU build divided the target's logits at draft positions
    by uninitialised temperatures (engine.vllm.fix_cpu_expand): it then accepted 0 of ~180 at position 2."""
    common = [
        "eval",
        "-t",
        str(trained["target"]),
        "--draft",
        str(trained["run"]),
        "--prompts",
        str(trained["data"]),
        "--num-prompts",
        "16",
        "--max-new-tokens",
        "32",
        "--temperature",
        "0.7",
        "-q",
    ]
    reports = {}
    for engine in ("torch", "vllm"):
        assert main([*common, "--engine", engine, "-o", str(tmp_path / engine)]) == 0
        reports[engine] = json.loads((tmp_path / engine / "eval.json").read_text())
    for report in reports.values():
        rule = report["settings"]["draft_sampling"], report["settings"]["acceptance_rule"]
        assert rule == ("greedy", "target-prob")
    assert (
        reports["vllm"]["engine"]["draft_sample_method"] == "greedy"
    )  # read from vLLM's own config

    (t, t_se), (v, v_se) = (
        _mean_and_se(_accepted_per_step(tmp_path / e)) for e in ("torch", "vllm")
    )
    steps = len(_accepted_per_step(tmp_path / "torch"))
    assert steps > 400 and t > 0.3, (
        "enough steps, and accepted drafts, for the band to mean something"
    )
    assert abs(t - v) <= 3 * (t_se**2 + v_se**2) ** 0.5, (t, t_se, v, v_se)
    ours, theirs = reports["torch"]["overall"], reports["vllm"]["overall"]
    for j, (a, n, b, m) in enumerate(
        zip(ours["accepted"], ours["verified"], theirs["accepted"], theirs["verified"])
    ):
        if min(n, m) < 30:
            continue
        pooled = (a + b) / (n + m)
        se = (pooled * (1 - pooled) * (1 / n + 1 / m)) ** 0.5
        assert abs(a / n - b / m) <= 3 * se, (j + 1, a, n, b, m)


def test_vllms_cpu_rejection_sampler_expands_each_requests_temperature_over_its_drafts():
    """The rejection sampler scales the target's logits at request i's draft positions by its temperature
    (expand_batch_to_tokens); vLLM 0.32's CPU kernel left that tensor uninitialised. With the engine's fix
    in, vLLM's own function returns each temperature (0: greedy, read as 1) repeated over its drafts."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from spec_cli.engine import vllm

    vllm.require()
    vllm.fix_cpu_expand()
    current_platform.register_triton_kernel_overrides()  # what an engine's worker does when it starts
    temperature, cu = torch.tensor([0.7, 0.0, 1.3]), torch.tensor([3, 5, 6], dtype=torch.int32)
    for _ in range(
        3
    ):  # fresh memory each time: a kernel that writes nothing shows other values each time
        expanded = rejection_sampler.expand_batch_to_tokens(
            temperature, cu, 6, replace_from=0, replace_to=1
        )
        assert expanded.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0, 1.0, 1.3])
    top_k = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([5, 0], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32), 3
    )
    assert top_k.tolist() == [5, 5, 0] and top_k.dtype == torch.int32


@pytest.mark.slow
def test_vllm_eval_reads_a_speculators_export_and_refuses_sglang(
    trained, torch_eval, tmp_path, capsys
):
    assert (
        main(
            [
                "export",
                str(trained["run"]),
                "--format",
                "speculators",
                "--dtype",
                "fp32",
                "--engine-check",
                "none",
                "-o",
                str(tmp_path / "spec"),
                "-q",
            ]
        )
        == 0
    )
    reference = torch_eval[0]  # the fp32 checkpoint in PyTorch
    report = _eval(trained, tmp_path / "spec", tmp_path / "vllm", "--engine", "vllm")
    assert report["overall"]["accepted"] == reference["overall"]["accepted"]
    assert report["draft"]["format"] == "speculators"
    assert (
        main(
            ["export", str(trained["run"]), "--format", "sglang", "-o", str(tmp_path / "sgl"), "-q"]
        )
        == 0
    )
    assert (
        main(
            [
                "eval",
                "-t",
                str(trained["target"]),
                "--draft",
                str(tmp_path / "sgl"),
                "--engine",
                "vllm",
                "-q",
            ]
        )
        == 1
    )
    assert "vLLM does not read a sglang export" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                "-t",
                str(trained["target"]),
                "--draft",
                str(trained["run"]),
                "--engine",
                "vllm",
                "--topk",
                "4",
                "-q",
            ]
        )
        == 1
    )
    assert "--topk 1 with --engine vllm" in capsys.readouterr().err


def test_export_engine_check_passes_and_reports_vllms_numbers(trained):
    out = trained["export"]  # written with the engine check left at auto: vLLM is here
    text = " ".join(trained["export_printed"].split())  # the summary table wraps lines
    assert "engine check passed: vLLM" in text
    assert "shares model.embed_tokens.weight with the target" in text  # the export has none
    served, reference = re.search(
        r"accepted per position (\[[\d, ]+\]) vs (\[[\d, ]+\])", text
    ).groups()
    assert served == reference and json.loads(served)[0] > 0
    assert (out / "model.safetensors").is_file()


def _tampered(trained, tmp_path: Path, how: str) -> Path:
    folder = tmp_path / how
    shutil.copytree(trained["export"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if how == "zeroed-d2t":
        tensors["d2t"] = torch.zeros_like(tensors["d2t"])
    elif how == "wrong-aux":  # e.g. ids written for another target depth: [2, 4, 5] -> [1, 2, 3]
        config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    elif how == "missing-key":
        del tensors["midlayer.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "how,expected",
    [
        ("zeroed-d2t", "draft tokens at only .*where the checkpoint accepts"),
        ("wrong-aux", "where the checkpoint accepts"),
        ("missing-key", "unloaded"),
    ],
)
def test_engine_check_catches_a_tampered_export(trained, tmp_path, how, expected):
    from spec_cli.eval.engine_check import engine_check
    from spec_cli.export import ExportCheckError
    from spec_cli.export.source import load_source

    folder = _tampered(trained, tmp_path, how)
    src = load_source(trained["run"])
    with pytest.raises(ExportCheckError, match=expected):
        engine_check(folder, "vllm", src, torch.float32, trained["target"], depth=3)


def _children() -> set[int]:
    import os

    me = os.getpid()
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                out.add(int(entry.name))
    return out


@pytest.mark.slow
def test_engines_are_released_on_ctrl_c_and_on_error(trained, tmp_path, monkeypatch, capsys):
    from spec_cli.engine import vllm

    opened, closed = [], []
    real_init, real_close, real_generate = (
        vllm.Engine.__init__,
        vllm.Engine.close,
        vllm.Engine.generate,
    )

    def init(self, *a, **k):
        real_init(self, *a, **k)
        opened.append(self)

    def close(self):
        if "llm" in self.__dict__:
            closed.append(self)
        real_close(self)

    calls = {"n": 0}

    def generate(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:  # past the warm-up, in the middle of the run
            raise KeyboardInterrupt
        return real_generate(self, *a, **k)

    before = _children()
    monkeypatch.setattr(vllm.Engine, "__init__", init)
    monkeypatch.setattr(vllm.Engine, "close", close)
    monkeypatch.setattr(vllm.Engine, "generate", generate)
    args = [
        "eval",
        "-t",
        str(trained["target"]),
        "--draft",
        str(trained["export"]),
        "--prompts",
        str(trained["data"]),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--engine",
        "vllm",
        "-q",
    ]
    assert main(args + ["-o", str(tmp_path / "a")]) == 130
    assert len(opened) == 2 and {id(e) for e in closed} == {id(e) for e in opened}
    assert all("llm" not in e.__dict__ for e in opened)
    assert not (tmp_path / "a" / "eval.json").exists()

    opened.clear(), closed.clear()

    def second_fails(self, *a, **k):  # the first engine loads, the second dies while loading
        if opened:
            raise RuntimeError("boom")
        init(self, *a, **k)

    monkeypatch.setattr(vllm.Engine, "__init__", second_fails)
    assert (
        main(args + ["-o", str(tmp_path / "b")]) == 2
    )  # an unexpected error: reported, engines closed
    assert len(opened) == 1 and len(closed) == 1
    assert _children() <= before  # no engine or worker process left behind
    capsys.readouterr()


def test_without_vllm_the_commands_say_how_to_install_it(trained, tmp_path, monkeypatch, capsys):
    from spec_cli.engine import vllm

    monkeypatch.setattr(vllm, "available", lambda: False)
    assert (
        main(
            [
                "eval",
                "-t",
                str(trained["target"]),
                "--draft",
                str(trained["export"]),
                "--engine",
                "vllm",
                "-q",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "needs vLLM, which is not installed" in err and "pip install -e '.[vllm]'" in err
    assert "Traceback" not in err
    assert (
        main(
            [
                "export",
                str(trained["run"]),
                "--format",
                "vllm",
                "--engine-check",
                "vllm",
                "-o",
                str(tmp_path / "x"),
                "-q",
            ]
        )
        == 1
    )
    assert "pip install -e '.[vllm]'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # auto: no vLLM, no check, and the export says so
    assert main(["export", str(trained["run"]), "--format", "vllm", "-o", str(tmp_path / "y")]) == 0
    assert "vLLM is not installed" in capsys.readouterr().out


def test_export_refuses_a_target_vllm_cannot_feed_an_eagle3_draft(trained, tmp_path, capsys):
    target = tmp_path / "gpt2-shaped"
    shutil.copytree(trained["target"], target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]  # a vLLM model class without SupportsEagle3
    (target / "config.json").write_text(json.dumps(config))
    out = tmp_path / "export"
    assert (
        main(
            [
                "export",
                str(trained["run"]),
                "--format",
                "vllm",
                "--engine-check",
                "vllm",
                "-t",
                str(target),
                "-o",
                str(out),
                "-q",
            ]
        )
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "GPT2LMHeadModel does not implement SupportsEagle3" in err and "--engine-check none" in err
    )
    assert not out.exists()


def test_building_an_engine_leaves_torchruns_local_world_size_alone(tmp_path, monkeypatch):
    """vLLM's CPU platform writes its tensor-parallel size into LOCAL_WORLD_SIZE in this process, which
    spec_cli reads as torchrun's ranks on the machine (threads, the stream store's share): it is put
    back as it was once the engine is built (here a stand-in LLM that does what vLLM does)."""
    import os
    from types import SimpleNamespace

    from spec_cli.engine import vllm as engine

    class LLM:
        def __init__(self, **kwargs):
            os.environ["LOCAL_WORLD_SIZE"] = str(kwargs.get("tensor_parallel_size", 1))

    monkeypatch.setattr(
        engine, "require", lambda what: SimpleNamespace(LLM=LLM, SamplingParams=None)
    )
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    engine.Engine(tmp_path)
    assert "LOCAL_WORLD_SIZE" not in os.environ
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # under torchrun
    engine.Engine(tmp_path)
    assert os.environ["LOCAL_WORLD_SIZE"] == "8"


def test_vllm_builds_its_engine_over_a_frozen_heap_that_is_thawed_after(tmp_path, monkeypatch):
    """vLLM runs full garbage collections while it loads the target and the draft; each walks every
    object in the process unless the heap is frozen. While the engine is built the heap is frozen
    (its collections then scan only what the load creates), and it is unfrozen again when the
    engine closes and when the build fails, so no object is kept from the collector for good."""
    import gc
    from types import SimpleNamespace

    from spec_cli.engine import vllm as engine
    from spec_cli.errors import ArtifactError

    seen = []

    class LLM:
        def __init__(self, **kwargs):
            seen.append(gc.get_freeze_count())
            if kwargs.get("seed") == 1:
                raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(
        engine, "require", lambda what: SimpleNamespace(LLM=LLM, SamplingParams=None)
    )
    assert gc.get_freeze_count() == 0
    with engine.Engine(tmp_path):
        assert seen[-1] > 1000  # the whole heap, frozen before vLLM's loader ran
    assert gc.get_freeze_count() == 0
    with pytest.raises(ArtifactError, match="no memory for the KV cache"):
        engine.Engine(tmp_path, seed=1)
    assert seen[-1] > 1000 and gc.get_freeze_count() == 0
