"""spec export knows, per engine and version, which target architectures it serves EAGLE-3 drafts for:
it refuses (or, with --allow-unsupported-target, warns about) a target the engine cannot capture aux
hidden states for, and warns where it does not know."""

import json

import pytest

from spec_cli.cli import main
from spec_cli.console import set_quiet
from spec_cli.draft.eagle3 import EAGLE3
from spec_cli.engine import vllm
from spec_cli.export import ExportError
from spec_cli.export import support as engine_support
from spec_cli.stages import export as stage
from tests.export.drafts import make_run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_tables_know_the_architectures_that_matter():
    # vLLM 0.32.0 (vllm/model_executor/models/gemma3.py: Gemma3ForCausalLM(nn.Module, SupportsLoRA, SupportsPP))
    assert engine_support.VLLM_VERSION == "0.32.0"
    for arch in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "Phi3ForCausalLM",
    ):
        assert arch in engine_support.VLLM_SERVED
    for arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma2ForCausalLM"):
        assert arch in engine_support.VLLM_NOT_SERVED
    assert not engine_support.VLLM_SERVED & engine_support.VLLM_NOT_SERVED
    # SGLang's gemma3_causal.py has set_eagle3_layers_to_capture; gemma2.py does not
    assert "Gemma3ForCausalLM" in engine_support.SGLANG_SERVED
    assert "Gemma2ForCausalLM" in engine_support.SGLANG_NOT_SERVED


def test_support_answers_by_engine(monkeypatch):
    monkeypatch.setattr(vllm, "version", lambda: None)  # no vLLM installed: the table answers
    gemma = engine_support.support("vllm", "Gemma3ForCausalLM")
    assert gemma.served is False and "SupportsEagle3" in gemma.reason and "0.32.0" in gemma.engine
    assert EAGLE3.format("speculators").engine == "vllm"  # vLLM reads it: the same answer
    assert engine_support.support("sglang", "Gemma3ForCausalLM").served is True
    assert engine_support.alternatives(
        EAGLE3.format("vllm"), EAGLE3.formats, "Gemma3ForCausalLM"
    ) == ["sglang"]
    assert (
        engine_support.alternatives(EAGLE3.format("sglang"), EAGLE3.formats, "Gemma3ForCausalLM")
        == []
    )
    assert engine_support.support("vllm", "NoSuchForCausalLM").served is None
    assert engine_support.support("sglang", "NoSuchForCausalLM").served is None


def test_another_installed_vllm_is_asked_itself(monkeypatch):
    """A supported release other than the table's is asked; one outside the range is not (the table answers)."""
    asked = []
    monkeypatch.setattr(
        vllm, "target_supports_eagle3", lambda arch: asked.append(arch) or (True, "")
    )
    monkeypatch.setattr(vllm, "version", lambda: "0.34.0")
    verdict = engine_support.support("vllm", "Gemma3ForCausalLM")
    assert (
        asked == ["Gemma3ForCausalLM"]
        and verdict.served is True
        and verdict.engine == "vLLM 0.34.0"
    )
    monkeypatch.setattr(vllm, "version", lambda: "0.99.0")
    verdict = engine_support.support("vllm", "Gemma3ForCausalLM")
    assert asked == ["Gemma3ForCausalLM"] and verdict.served is False and "0.32.0" in verdict.engine


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("gemma3"), target_architecture="Gemma3ForCausalLM")


def test_a_target_vllm_cannot_serve_is_refused_with_the_reason(gemma_run, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm, "version", lambda: None)
    for fmt in ("vllm", "speculators"):
        with pytest.raises(
            ExportError, match="vLLM 0.32.0 cannot serve an EAGLE-3 draft"
        ) as caught:
            stage.run(stage.ExportConfig(source=gemma_run, format=fmt, output=tmp_path / fmt))
        assert "Gemma3ForCausalLM does not implement SupportsEagle3" in caught.value.message
        assert (
            "--format sglang" in caught.value.hint
            and "--allow-unsupported-target" in caught.value.hint
        )
        assert not (tmp_path / fmt).exists()


def test_the_flag_writes_it_with_a_warning(gemma_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm, "version", lambda: None)
    result = stage.run(
        stage.ExportConfig(
            source=gemma_run, format="vllm", output=tmp_path / "out", allow_unsupported_target=True
        )
    )
    assert "warning:" in capsys.readouterr().err
    recorded = json.loads((result.output / "config.json").read_text())["spec_cli"]["engine_support"]
    assert recorded["served"] is False and "SupportsEagle3" in recorded["reason"]
    assert "## Engine support" in (result.output / "README.md").read_text()
    # served through vLLM's Transformers backend, as the refusal says: the printed and written command has it
    assert (
        "vllm serve " in result.serve_command
        and " --model-impl transformers " in result.serve_command
    )
    assert result.serve_command in (result.output / "README.md").read_text()
    assert result.check is not None  # the folder itself is still checked
    assert dict(result.summary_rows())["engine support"].startswith("WARNING")
    # the same through the command line
    assert (
        main(["export", str(gemma_run), "--format", "vllm", "-o", str(tmp_path / "cli"), "-q"]) == 1
    )
    assert (
        main(
            [
                "export",
                str(gemma_run),
                "--format",
                "vllm",
                "-o",
                str(tmp_path / "cli"),
                "-q",
                "--allow-unsupported-target",
            ]
        )
        == 0
    )
    set_quiet(False)  # -q is process-wide


def test_sglang_serves_gemma3_and_an_unknown_target_is_a_warning(
    gemma_run, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(vllm, "version", lambda: None)
    set_quiet(False)
    result = stage.run(
        stage.ExportConfig(source=gemma_run, format="sglang", output=tmp_path / "sglang")
    )
    recorded = json.loads((result.output / "config.json").read_text())["spec_cli"]["engine_support"]
    assert (
        recorded["served"] is True
        and "## Engine support" not in (result.output / "README.md").read_text()
    )
    capsys.readouterr()
    unknown = make_run(tmp_path / "unknown", target_architecture="BrandNewForCausalLM")
    result = stage.run(
        stage.ExportConfig(source=unknown, format="vllm", output=tmp_path / "unknown-vllm")
    )
    assert "has no native model class for BrandNewForCausalLM" in " ".join(
        capsys.readouterr().err.split()
    )
    assert (
        json.loads((result.output / "config.json").read_text())["spec_cli"]["engine_support"][
            "served"
        ]
        is None
    )


@pytest.mark.engine
def test_the_vllm_table_is_what_the_installed_vllm_says():
    """The table against vLLM itself (its registry and SupportsEagle3), for the families spec_cli tests."""
    if vllm.version() != engine_support.VLLM_VERSION:
        pytest.skip(f"needs vLLM {engine_support.VLLM_VERSION} installed (found {vllm.version()})")
    for arch in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
    ):
        served, why = vllm.target_supports_eagle3(arch)
        assert served == (arch in engine_support.VLLM_SERVED), (arch, why)
