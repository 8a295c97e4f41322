"""Issue 27: bad input never loses data. Each mistake gets one line and exit 1, and nothing of the
user's is touched (files compared byte for byte)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from spec_cli.artifacts import feature_cache as fc
from spec_cli.cli import main
from tests import tiny
from tests.conftest import signalled_child, wait_for, write_jsonl


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_llama_dir):
    """Data, a vocab map and one small cache, all through the CLI."""
    root = tmp_path_factory.mktemp("mistakes")
    rng = random.Random(3)
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(24)])
    vm, cache = root / "vm.safetensors", root / "cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(tiny_llama_dir),
                    "-d",
                    str(data),
                    "--draft-vocab-size",
                    "64",
                    "-o",
                    str(vm),
                    "-q",
                ]
            )
            == 0
        )
        assert main(precompute_args(tiny_llama_dir, data, vm, cache)) == 0
    finally:
        mp.undo()
    assert fc.read_manifest(cache)["num_shards"] >= 2
    return {"root": root, "data": data, "vm": vm, "cache": cache, "target": tiny_llama_dir}


def precompute_args(target, data, vm, out, *extra) -> list[str]:
    return [
        "precompute",
        "-t",
        str(target),
        "-d",
        str(data),
        "-v",
        str(vm),
        "-o",
        str(out),
        "--batch-tokens",
        "256",
        "--shard-tokens",
        "300",
        "-q",
        *extra,
    ]


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    return " ".join(err.split())


def copy_cache(made, tmp_path) -> Path:
    out = tmp_path / "cache"
    shutil.copytree(made["cache"], out)
    return out


# ----------------------------------------------------------------------------- 1. precompute --no-resume


def test_no_resume_refuses_a_folder_holding_other_files(made, tmp_path, capsys):
    out = tmp_path / "work"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    (out / "sub").mkdir()
    (out / "sub" / "thesis.tex").write_text("chapter 1\n")
    before = snapshot(out)
    assert main(precompute_args(made["target"], made["data"], made["vm"], out, "--no-resume")) == 1
    msg = one_error(capsys)
    assert (
        f"-o {out} is a folder holding files spec_cli did not write, not a feature cache; it is never "
        "replaced; pass another -o (--no-resume replaces only a feature cache that spec_cli wrote)"
        in msg
    )
    assert snapshot(out) == before


def test_no_resume_refuses_the_folder_holding_its_own_data(made, tmp_path, capsys):
    out = tmp_path / "inputs"
    out.mkdir()
    data = out / "chat.jsonl"
    shutil.copy(made["data"], data)
    before = snapshot(out)
    assert main(precompute_args(made["target"], data, made["vm"], out, "--no-resume")) == 1
    assert f"-o {out} holds this command's input --data {data}; nothing was written" in one_error(
        capsys
    )
    assert snapshot(out) == before


def test_no_resume_refuses_a_cache_with_a_foreign_file_and_replaces_a_clean_one(
    made, tmp_path, capsys
):
    out = copy_cache(made, tmp_path)
    (out / "keep.me").write_text("mine")
    before = snapshot(out)
    assert main(precompute_args(made["target"], made["data"], made["vm"], out, "--no-resume")) == 1
    assert "besides the feature cache it holds keep.me" in one_error(capsys)
    assert snapshot(out) == before
    (out / "keep.me").unlink()
    assert main(precompute_args(made["target"], made["data"], made["vm"], out, "--no-resume")) == 0
    assert (out / fc.MANIFEST).is_file() and (out / ".spec.lock").is_file()
    assert fc.folder_bytes(out) == fc.folder_bytes(made["cache"])  # the lock is not counted


def test_a_run_killed_after_writing_only_its_head_resumes(made, tmp_path):
    """precompute writes the cache's head before any shard: a run killed between the two leaves a
    folder holding the head alone, which the rerun of the same command takes up, not refuses as a
    folder of the user's."""
    out = copy_cache(made, tmp_path)
    for p in out.iterdir():
        if p.name != fc.HEAD:
            p.unlink()
    assert main(precompute_args(made["target"], made["data"], made["vm"], out)) == 0
    assert fc.folder_bytes(out) == fc.folder_bytes(made["cache"])


# ----------------------------------------------------------------------------- 2. verified caches


def test_a_truncated_shard_is_named_on_every_read(made, tmp_path, capsys):
    out = copy_cache(made, tmp_path)
    shard = out / fc.shard_name(1)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size - 100])
    assert main(["inspect", str(out)]) == 1
    msg = one_error(capsys)
    assert f"shard-00001.safetensors has {size - 100} bytes, the manifest says {size}" in msg
    assert f"--no-resume -o {out}" in msg
    # a rerun of precompute does not take the damaged cache as complete
    assert main(precompute_args(made["target"], made["data"], made["vm"], out)) == 1
    assert "shard-00001.safetensors has" in one_error(capsys)
    shard.unlink()
    assert main(["inspect", str(out)]) == 1
    assert "shard-00001.safetensors is missing" in one_error(capsys)


def test_an_old_manifest_without_sizes_falls_back_to_the_header_check(made, tmp_path, capsys):
    out = copy_cache(made, tmp_path)
    manifest = json.loads((out / fc.MANIFEST).read_text())
    for entry in manifest["shards"]:
        del entry["bytes"]
    (out / fc.MANIFEST).write_text(json.dumps(manifest))
    shard = out / fc.shard_name(0)
    shard.write_bytes(shard.read_bytes()[:-50])
    assert main(["inspect", str(out)]) == 1
    assert f"{shard} is not a readable safetensors file" in one_error(capsys)


def test_verify_hashes_every_shard_and_names_the_damaged(made, tmp_path, capsys):
    out = copy_cache(made, tmp_path)
    assert main(["inspect", str(out), "--verify"]) == 0
    assert "shards match their checksums" in capsys.readouterr().out
    shard = out / fc.shard_name(0)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    assert main(["inspect", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--verify"]) == 1
    msg = one_error(capsys)
    assert "shard-00000.safetensors fails its checksum (1 of" in msg and "shard-00001" not in msg


def test_a_hand_edited_manifest_is_caught_against_the_tensors(made, tmp_path, capsys):
    out = copy_cache(made, tmp_path)
    manifest = json.loads((out / fc.MANIFEST).read_text())
    n, hidden = len(manifest["aux_layers"]), manifest["hidden_size"]
    (out / fc.MANIFEST).write_text(
        json.dumps({**manifest, "aux_layers": manifest["aux_layers"][:-1]})
    )
    assert main(["inspect", str(out)]) == 1
    assert (
        f"stores aux states {n * hidden} wide, but manifest.json says {n - 1} aux layers"
        in one_error(capsys)
    )
    (out / fc.MANIFEST).write_text(json.dumps({**manifest, "encoding": "probs"}))
    assert main(["inspect", str(out)]) == 1
    assert "lacks target_p, target_mass, which encoding 'probs'" in one_error(capsys)


def test_an_export_with_edited_aux_layers_is_refused(tmp_path, capsys):
    out = tmp_path / "export"
    out.mkdir()
    save_file({"fc.weight": torch.zeros(8, 3 * 8)}, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 8,
        "target_hidden_size": 8,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    }
    (out / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(out)]) == 0
    capsys.readouterr()
    (out / "config.json").write_text(
        json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [1, 2]})
    )
    assert main(["inspect", str(out)]) == 1
    assert (
        "lists 2 aux layers ([1, 2]), but fc.weight takes 24 inputs, not 2 x 8 = 16"
        in one_error(capsys)
    )


# ----------------------------------------------------------------------------- 3. regenerate -o


def test_regenerate_refuses_a_folder_as_output_up_front(made, tmp_path, capsys):
    out = tmp_path / "existing"
    out.mkdir()
    assert (
        main(
            ["regenerate", "-t", str(made["target"]), "-d", str(made["data"]), "-o", str(out), "-q"]
        )
        == 1
    )
    msg = one_error(capsys)
    assert (
        f"-o {out} is a folder (a folder holding files spec_cli did not write); chat data written by spec "
        "regenerate is one file" in msg
    )
    assert list(out.iterdir()) == [] and not Path(str(out) + ".parts").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert (
        main(
            [
                "regenerate",
                "-t",
                str(made["target"]),
                "-d",
                str(made["data"]),
                "-o",
                str(afile / "out.jsonl"),
                "-q",
            ]
        )
        == 1
    )
    assert f"{afile} is a file, not a folder" in one_error(capsys)
    assert afile.read_text() == "x"


def test_regenerate_keeps_a_parts_folder_holding_foreign_files(tmp_path):
    from spec_cli.errors import ArtifactError
    from spec_cli.stages import regenerate

    folder = tmp_path / "out.jsonl.parts"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    (folder / "part-00000.json").write_text("{}")
    (folder / "mine.txt").write_text("keep")
    with pytest.raises(ArtifactError, match="besides the regenerate work folder it holds mine.txt"):
        regenerate._remove_parts(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["mine.txt", "part-00000.json", "state.json"]
    (folder / "mine.txt").unlink()
    regenerate._remove_parts(folder)
    assert not folder.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_during_precompute_keeps_finished_shards_and_exits_with_its_code(
    made, tmp_path, sig, code
):
    """Ctrl-C (SIGINT) or a scheduler's SIGTERM: the shards written are kept, verified, for the rerun."""
    out = tmp_path / "cache"
    cmd = [
        sys.executable,
        "-m",
        "spec_cli.cli",
        *precompute_args(made["target"], made["data"], made["vm"], out),
    ]
    env = {**os.environ, "SPEC_TEST_SHARD_DELAY": "2", "SPEC_HOME": str(made["root"] / "home")}
    with signalled_child(cmd, env=env, stderr=subprocess.PIPE, text=True) as proc:
        wait_for(out / "shard-00000.json", proc, "precompute")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Exception" not in err, err  # -q: not even the one line
    assert (out / "shard-00000.safetensors").is_file() and not (out / fc.MANIFEST).exists()
    assert (
        fc.completed_shard(
            out, 0, {k: fc.read_manifest(made["cache"])[k] for k in fc.IDENTITY_KEYS}
        )
        == fc.read_manifest(made["cache"])["shards"][0]
    )


# ----------------------------------------------------------------------------- 4. build-vocab-map -o


def test_build_vocab_map_refuses_to_overwrite_unless_forced(made, tmp_path, capsys):
    base = [
        "build-vocab-map",
        "-t",
        str(made["target"]),
        "-d",
        str(made["data"]),
        "--draft-vocab-size",
        "64",
        "-q",
    ]
    precious = tmp_path / "precious.safetensors"
    precious.write_bytes(b"not a vocab map")
    assert main([*base, "-o", str(precious)]) == 1
    assert (
        f"-o {precious} is a .safetensors file (weights or tensors) spec_cli did not write, not a vocab map; "
        "it is never replaced" in one_error(capsys)
    )
    assert precious.read_bytes() == b"not a vocab map"
    other = tmp_path / "vm.safetensors"
    shutil.copy(made["vm"], other)
    before = other.read_bytes()
    assert main([*base[:-3], "--draft-vocab-size", "32", "-q", "-o", str(other)]) == 1
    assert (
        "already holds a vocab map made from other inputs (draft_vocab_size differ)"
        in one_error(capsys)
    )
    assert other.read_bytes() == before
    assert main([*base, "-o", str(other)]) == 0  # the same inputs: rewritten, the same bytes
    assert other.read_bytes() == before
    assert (
        main([*base, "-o", str(precious), "--force"]) == 1
    )  # --force replaces vocab maps, nothing else
    assert "(--force replaces only a vocab map that spec_cli wrote)" in one_error(capsys)
    assert precious.read_bytes() == b"not a vocab map"
    assert main([*base[:-3], "--draft-vocab-size", "32", "-q", "-o", str(other), "--force"]) == 0
    assert other.read_bytes() != before


def test_empty_data_file_says_it_is_empty(made, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(made["target"]),
                "-d",
                str(empty),
                "--draft-vocab-size",
                "64",
                "-o",
                str(tmp_path / "vm.safetensors"),
                "-q",
            ]
        )
        == 1
    )
    assert f"{empty} is empty: it holds no records" in one_error(capsys)


# ----------------------------------------------------------------------------- 5. serve-target fields


def test_serve_target_answers_400_naming_a_malformed_field(tiny_llama_dir):
    from spec_cli.serve import wire
    from spec_cli.serve.server import TargetServer
    from tests.serve.harness import draft_vocab, load_backend, random_batch

    backend = load_backend(tiny_llama_dir)
    try:
        server = TargetServer(backend)
        ok = server.handle(
            "POST",
            "/v1/vocab_mapping",
            {},
            wire.encode({"selected_token_ids": draft_vocab()}).tobytes(),
        )
        vid = wire.loads(ok.body())["vocab_id"]
        ids, am, lm = random_batch(2, 8, 0)
        tensors = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
        cases = [
            (
                "/v1/generate",
                wire.encode(tensors, {"vocab_id": [1, 2]}).tobytes(),
                "vocab_id must be a string",
            ),
            (
                "/v1/generate",
                wire.encode(tensors, {"vocab_id": vid, "final_hidden": "yes"}).tobytes(),
                "final_hidden must be true or false",
            ),
            (
                "/v1/output_head",
                json.dumps({"vocab_id": [vid]}).encode(),
                "vocab_id must be a string",
            ),
        ]
        for path, body, why in cases:
            answer = server.handle("POST", path, {}, body)
            assert answer.status == 400 and why in wire.loads(answer.body())["error"], answer.body()
        assert (
            server.handle(
                "POST", "/v1/generate", {}, wire.encode(tensors, {"vocab_id": vid}).tobytes()
            ).status
            == 200
        )
    finally:
        backend.close()


# ----------------------------------------------------------------------------- one line each (issue 51)


def test_a_record_that_is_not_utf8_is_named_by_number(made, tmp_path, capsys):
    lines = made["data"].read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        b"".join(lines[:4])
        + lines[4].replace(b'"value": "', b'"value": "\xff\xfe', 1)
        + b"".join(lines[5:])
    )
    byte = lines[4].index(b'"value": "') + len(b'"value": "') + 1  # counted from 1
    assert main(precompute_args(made["target"], bad, made["vm"], tmp_path / "cache")) == 1
    assert one_error(capsys) == (
        f"error: {bad}: record 5 (line 5, byte {byte} of the line) is not valid UTF-8; "
        "fix or remove it (data files are read as UTF-8)"
    )
    assert not (tmp_path / "cache").exists()


def test_a_json_file_of_no_records_says_so(made, tmp_path, capsys):
    empty = tmp_path / "none.json"
    empty.write_text("[]")
    assert main(precompute_args(made["target"], empty, made["vm"], tmp_path / "cache")) == 1
    assert one_error(capsys) == (
        f"error: no records in {empty}; pass a file that holds conversations (a JSON "
        "list of records, or JSON lines)"
    )


def test_a_vocab_map_option_given_a_folder_says_what_it_is_and_where_the_map_is(
    made, tmp_path, capsys
):
    assert main(precompute_args(made["target"], made["data"], made["cache"], tmp_path / "c2")) == 1
    assert one_error(capsys).startswith(
        f"error: --vocab-map {made['cache']} is a feature cache, not a vocab map "
        "file; pass the vocab map file the cache was made with"
    )
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--cache",
                str(made["cache"]),
                "-v",
                str(made["vm"]),
                "-o",
                str(run),
                "--max-steps",
                "1",
                "--ttt-steps",
                "2",
                "--batch-tokens",
                "256",
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
                str(made["cache"]),
                "-v",
                str(run),
                "-o",
                str(tmp_path / "run2"),
                "-q",
            ]
        )
        == 1
    )
    assert one_error(capsys) == (
        f"error: --vocab-map {run} is a training run, not a vocab map file; pass the "
        f"vocab map file the run was trained with: {made['vm']}"
    )


def test_inspect_of_an_unfinished_cache_says_how_to_finish_it(made, tmp_path, capsys):
    cache = copy_cache(made, tmp_path)
    (cache / fc.MANIFEST).unlink()
    shards = len(list(cache.glob("shard-*.safetensors")))
    assert main(["inspect", str(cache)]) == 1
    assert one_error(capsys) == (
        f"error: {cache} is an unfinished feature cache ({shards} shard(s) written, no "
        "manifest.json yet); rerun the same `spec precompute` command to finish it (it "
        "keeps the shards it verifies)"
    )
