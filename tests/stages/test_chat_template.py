"""--chat-template through the stages on a tiny BASE target (a tokenizer with no chat template): the one
error naming the option, the template recorded in the vocab map, cache, run and export, and every stage
refusing an artifact made with another template."""

import json
import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.cli import main
from spec_cli.console import set_quiet
from spec_cli.data import chat_templates
from spec_cli.errors import ArtifactError, ConfigError
from spec_cli.eval import drafts
from spec_cli.stages import export as export_stage
from spec_cli.stages import precompute as precompute_stage
from spec_cli.stages import train as train_stage
from spec_cli.targets import loading
from tests import tiny
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base model: Gemma's control tokens in its vocabulary, no chat template; tiny random Llama weights."""
    root = tmp_path_factory.mktemp("base")
    target = root / "tiny-base"
    tokenizer = tiny.build_tokenizer("gemma")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(target))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny.tiny_config("llama3", len(tokenizer))).save_pretrained(
        str(target)
    )
    rng = random.Random(5)
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(24)])
    other = root / "other.jinja"  # a file template unlike the family's: `model:` headers, no bos
    other.write_text(
        "{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' "
        "else m['role']) + ':\\n' + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model:\\n' }}{% endif %}"
    )
    home = root / "home"
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(home))
    try:
        for name, template in (("gemma", "gemma"), ("file", str(other))):
            assert (
                main(
                    [
                        "build-vocab-map",
                        "-t",
                        str(target),
                        "-d",
                        str(data),
                        "--draft-vocab-size",
                        "64",
                        "-o",
                        str(root / f"vm-{name}.safetensors"),
                        "--chat-template",
                        template,
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
                    str(root / "vm-gemma.safetensors"),
                    "-o",
                    str(root / "cache"),
                    "--chat-template",
                    "gemma",
                    "--batch-tokens",
                    "512",
                    "-q",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
        set_quiet(False)
    return {
        "target": target,
        "data": data,
        "other": other,
        "root": root,
        "vm": {n: root / f"vm-{n}.safetensors" for n in ("gemma", "file")},
        "cache": root / "cache",
    }


@pytest.mark.slow
def test_a_base_target_without_the_option_is_one_error_naming_it(base, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spec_cli.cli",
            "build-vocab-map",
            "-t",
            str(base["target"]),
            "-d",
            str(base["data"]),
            "--draft-vocab-size",
            "64",
            "-o",
            str(tmp_path / "v"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert (
        len(lines) == 1 and "has no chat template" in lines[0] and "--chat-template" in lines[0]
    ), out.stderr
    assert "rejected" not in out.stderr and not (tmp_path / "v").exists()


def test_the_vocab_maps_record_their_template(base):
    gemma, other = (load_vocab_map(base["vm"][n]).metadata for n in ("gemma", "file"))
    assert gemma["chat_template_source"] == "family gemma"
    assert gemma["chat_template_sha256"] == chat_templates.resolve("gemma").sha256
    assert other["chat_template_source"] == str(base["other"].resolve())
    assert other["chat_template_sha256"] == chat_templates.resolve(str(base["other"])).sha256
    assert gemma["tokenizer_fingerprint"] != other["tokenizer_fingerprint"]
    bare = loading.tokenizer_fingerprint(loading.load_tokenizer(base["target"]))
    assert bare not in (gemma["tokenizer_fingerprint"], other["tokenizer_fingerprint"])


def precompute(base, vm: str, template, out):
    return precompute_stage.run(
        precompute_stage.PrecomputeConfig(
            target=str(base["target"]),
            data=str(base["data"]),
            vocab_map=base["vm"][vm],
            output=out,
            batch_tokens=512,
            chat_template=template,
        )
    )


def test_a_vocab_map_and_a_cache_made_with_one_template_are_refused_with_another(base, tmp_path):
    manifest = json.loads((base["cache"] / "manifest.json").read_text())
    assert manifest["chat_template_sha256"] == chat_templates.resolve("gemma").sha256
    assert manifest["chat_template_source"] == "family gemma"
    with pytest.raises(
        ArtifactError, match="was made with the chat template of family gemma"
    ) as caught:
        precompute(base, "gemma", "chatml", tmp_path / "c")
    assert "family chatml" in caught.value.message and caught.value.hint.startswith(
        "pass --chat-template gemma"
    )
    with pytest.raises(ArtifactError, match="renders conversations with no chat template"):
        precompute(base, "gemma", None, tmp_path / "c")
    # a vocab map that matches the new template, but -o holds the cache made with the gemma one
    with pytest.raises(
        ArtifactError,
        match="the feature cache in .* was made with the chat template of family gemma",
    ) as caught:
        precompute(base, "file", str(base["other"]), base["cache"])
    assert "--no-resume" in caught.value.hint
    # the same template again: the finished cache is reused
    assert precompute(base, "gemma", "gemma", base["cache"]).computed_shards == 0


def train_config(base, out, **kw):
    values = dict(
        vocab_map=base["vm"]["gemma"],
        output=out,
        ttt_steps=2,
        max_steps=1,
        eval_fraction=0.0,
        batch_tokens=512,
        save_every=1,
        log_every=1,
    )
    values.update(kw)
    return train_stage.TrainConfig.from_options(**values)


def test_train_checks_the_template_and_the_draft_records_it(base, tmp_path):
    with pytest.raises(ConfigError, match="--chat-template is for a live --target"):
        train_stage.run(
            train_config(base, tmp_path / "a", cache=base["cache"], chat_template="gemma")
        )
    with pytest.raises(ArtifactError, match="was made with the chat template of family gemma"):
        train_stage.run(
            train_config(
                base,
                tmp_path / "b",
                target=str(base["target"]),
                data=str(base["data"]),
                chat_template=str(base["other"]),
            )
        )

    result = train_stage.run(train_config(base, tmp_path / "run", cache=base["cache"]))
    config = loading.load_config(base["target"])
    loaded = drafts.load_draft(result.run_dir, config)
    c = loaded.model.config
    assert c.chat_template_source == "family gemma"
    assert c.chat_template_sha256 == chat_templates.resolve("gemma").sha256
    assert c.rope_source.startswith("target rope_parameters: theta")

    # eval: a draft trained on gemma-rendered data, evaluated with another template, is refused by name
    chatml = chat_templates.resolve("chatml")
    with pytest.raises(
        ArtifactError,
        match="the draft's training data was made with the chat template of family gemma",
    ):
        drafts.check_target(
            loaded,
            base["target"],
            config,
            loading.load_tokenizer(base["target"], chatml),
            True,
            chatml,
        )
    gemma = chat_templates.resolve("gemma")
    drafts.check_target(
        loaded, base["target"], config, loading.load_tokenizer(base["target"], gemma), True, gemma
    )

    # the export says which template to serve with
    exported = export_stage.run(
        export_stage.ExportConfig(source=result.run_dir, format="vllm", output=tmp_path / "export")
    )
    readme = (exported.output / "README.md").read_text()
    assert "family gemma (sha256" in readme
    provenance = json.loads((exported.output / "config.json").read_text())["spec_cli"]
    assert provenance["chat_template_source"] == "family gemma"


@pytest.mark.slow
def test_serve_target_ships_its_template_and_a_remote_trainer_checks_it(base, tmp_path):
    from spec_cli.serve.client import RemoteBackend
    from tests.serve.harness import ServerProcess

    server = ServerProcess(base["target"], chat_template="gemma")
    try:
        remote = RemoteBackend(server.url)
        try:
            expected = load_vocab_map(base["vm"]["gemma"]).metadata["tokenizer_fingerprint"]
            assert (
                remote.info["tokenizer_fingerprint"] == expected
            )  # the template is in the fingerprint
            assert (
                remote.load_tokenizer(tmp_path / "tok").chat_template
                == chat_templates.resolve("gemma").text
            )
        finally:
            remote.close()
        # the server's template is the vocab map's: a remote run trains without --chat-template ...
        result = train_stage.run(
            train_config(base, tmp_path / "remote", remote=server.url, data=str(base["data"]))
        )
        assert (
            drafts.load_draft(result.run_dir, None).model.config.chat_template_source
            == "family gemma"
        )
        # ... and one that renders with another template is refused by name
        with pytest.raises(ArtifactError, match="was made with the chat template of family gemma"):
            train_stage.run(
                train_config(
                    base,
                    tmp_path / "other",
                    remote=server.url,
                    data=str(base["data"]),
                    chat_template=str(base["other"]),
                )
            )
    finally:
        server.kill()
