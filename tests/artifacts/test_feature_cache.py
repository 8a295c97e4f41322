"""The feature cache on disk: shard sidecars, the reader's view of tokens and the batch plan, the
integrity checks that refuse a damaged or foreign shard, and the bytes-per-token estimate."""

import hashlib
import json

import pytest
import torch

from spec_cli.artifacts import feature_cache as fc
from spec_cli.errors import ArtifactError
from tests.artifacts.caches import VD, H, identity, random_samples, write_cache

SHARDS = [[[0, 1], [2]], [[3, 4, 5]]]  # shard -> batches -> sample indices


@pytest.fixture
def cache(tmp_path):
    samples = random_samples(6)
    return {
        "folder": tmp_path / "cache",
        "samples": samples,
        **write_cache(tmp_path / "cache", samples, SHARDS),
    }


def damage(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor's bytes: the file still opens
    path.write_bytes(bytes(data))


def test_each_shard_has_a_sidecar_with_its_checksum_and_counts(cache):
    for index, entry in enumerate(cache["entries"]):
        path = cache["folder"] / fc.shard_name(index)
        data = path.read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
        assert (entry["samples"], entry["batches"]) == (
            sum(map(len, SHARDS[index])),
            len(SHARDS[index]),
        )
        assert entry["tokens"] == sum(len(cache["samples"][i]) for b in SHARDS[index] for i in b)
        assert json.loads(path.with_suffix(".json").read_text()) == entry
    manifest = fc.read_manifest(cache["folder"])
    assert (manifest["num_shards"], manifest["num_samples"], manifest["num_batches"]) == (2, 6, 3)
    assert manifest["num_tokens"] == sum(len(s) for s in cache["samples"])


def test_the_reader_returns_the_stored_tokens_and_batch_plan(cache):
    reader = fc.FeatureCacheReader(cache["folder"], verify=True)
    order = [i for shard in SHARDS for batch in shard for i in batch]  # cache order
    locations = list(reader.locations())
    assert [gid for *_, gid in locations] == list(range(6))
    for (shard, start, end, gid), sample in zip(locations, order):
        assert torch.equal(
            reader.read(shard, "input_ids", start, end).long(), cache["samples"][sample]
        )
        stored = cache["shards"][shard]
        assert torch.equal(
            reader.read(shard, "aux_hidden", start, end), stored["aux_hidden"][start:end]
        )
    assert reader.batches() == [
        [0, 1],
        [2],
        [3, 4, 5],
    ]  # global ids: shard 1 continues after shard 0
    head, meta = reader.head()
    assert torch.equal(head["selected_token_ids"], cache["selected"]) and meta["softcap"] is None
    assert torch.equal(head["lm_head_selected"], cache["head"]["lm_head_selected"])
    reader.close()


def test_a_corrupted_shard_is_refused_with_a_clear_message(cache):
    damage(cache["folder"] / fc.shard_name(1))
    with pytest.raises(ArtifactError, match=r"shard-00001\.safetensors fails its checksum") as err:
        fc.FeatureCacheReader(cache["folder"], verify=True)
    assert "--no-resume -o " + str(cache["folder"]) in err.value.hint
    # precompute's resume keeps the intact shard and recomputes the damaged one
    assert fc.completed_shard(cache["folder"], 0, cache["identity"]) == cache["entries"][0]
    assert fc.completed_shard(cache["folder"], 1, cache["identity"]) is None
    (cache["folder"] / fc.shard_name(1)).unlink()
    with pytest.raises(ArtifactError, match="shard-00001.safetensors is missing"):
        fc.FeatureCacheReader(cache["folder"])


def test_a_shard_killed_before_its_sidecar_is_kept_and_described_again(cache):
    sidecar = cache["folder"] / "shard-00000.json"
    sidecar.unlink()
    assert fc.completed_shard(cache["folder"], 0, cache["identity"]) == cache["entries"][0]
    assert json.loads(sidecar.read_text()) == cache["entries"][0]
    (cache["folder"] / fc.shard_name(1)).write_bytes(b"half a shard")
    assert (
        fc.completed_shard(cache["folder"], 1, cache["identity"]) is None
    )  # unreadable: recompute it
    assert fc.completed_shard(cache["folder"], 5, cache["identity"]) is None  # not written yet


def test_a_shard_made_differently_is_never_mixed_in(cache):
    with pytest.raises(
        ArtifactError,
        match=r"aux layers: cache has \[1, 3, 4\], this run has \[1, 2, 3\] "
        r"\(--aux-layers\)",
    ) as err:
        fc.completed_shard(cache["folder"], 0, identity(aux_layers=[1, 2, 3]))
    assert "--no-resume" in err.value.hint


def test_identity_mismatch_names_the_first_differing_key():
    found = identity()
    assert fc.identity_mismatch(identity(), found) is None
    why = fc.identity_mismatch(identity(encoding="probs", max_length=128), found)
    assert (
        why == "encoding: cache has 'hidden', this run has 'probs' (--encoding)"
    )  # encoding comes first
    why = fc.identity_mismatch(identity(target_fingerprint="x" * 16), found)
    assert why == f"target fingerprint: cache has {'t' * 16!r}, this run has {'x' * 16!r}"
    old = {
        k: v for k, v in found.items() if k != "chat_template_sha256"
    }  # written before the key existed
    assert fc.identity_mismatch(identity(), old) is None


def test_a_folder_without_a_manifest_says_whether_to_resume_or_start(tmp_path, cache):
    (cache["folder"] / fc.MANIFEST).unlink()
    with pytest.raises(ArtifactError, match="has no manifest.json") as err:
        fc.read_manifest(cache["folder"])
    assert "rerun the same `spec precompute` command to resume" in err.value.hint
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError) as err:
        fc.read_manifest(tmp_path / "empty")
    assert err.value.hint == "run `spec precompute` first"
    (tmp_path / "empty" / fc.MANIFEST).write_text(
        json.dumps({"kind": "feature_cache", "schema_version": 99})
    )
    with pytest.raises(ArtifactError, match="not a feature cache of schema 1"):
        fc.read_manifest(tmp_path / "empty")


@pytest.mark.parametrize("encoding", ["hidden", "probs"])
def test_bytes_per_token_is_what_a_shard_stores_per_token(tmp_path, encoding):
    samples = random_samples(3)
    stored = write_cache(tmp_path, samples, [[[0, 1, 2]]], encoding=encoding)["shards"][0]
    tokens = stored["input_ids"].numel()
    per_token = {
        k: v for k, v in stored.items() if v.shape[0] == tokens
    }  # not the offsets / sample ids
    measured = sum(v.numel() * v.element_size() for v in per_token.values()) / tokens
    assert fc.bytes_per_token(encoding, H, VD, "float32", 3) == measured
    assert fc.bytes_per_token(encoding, H, VD, "bfloat16", 3) < measured  # the float features halve


def test_folder_bytes_counts_each_kind_of_file(cache):
    folder = cache["folder"]
    (folder / "sub").mkdir()
    size = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    sizes = fc.folder_bytes(folder)
    assert sizes["head"] == size[fc.HEAD] and sizes["manifest"] == size[fc.MANIFEST]
    assert sizes["shards"] == sum(
        v for k, v in size.items() if k.startswith("shard-")
    )  # sidecars included
    assert sizes["total"] == sum(size.values())


def test_a_killed_writers_temporaries_are_removed_and_nothing_else(tmp_path):
    """A SIGKILL inside an atomic write leaves `.NAME.XXXX.tmp`; precompute removes the cache's own
    (under its lock) and never a file of the user's."""
    own = [
        ".shard-00000.safetensors.4dbces7y.tmp",
        ".shard-00012.json.a1b2.tmp",
        f".{fc.HEAD}.zz.tmp",
        f".{fc.MANIFEST}.q9.tmp",
    ]
    theirs = [
        ".notes.txt.x.tmp",
        "shard-00000.safetensors",
        ".shard-0.safetensors.x.tmp",
        "data.tmp",
    ]
    for name in own + theirs:
        (tmp_path / name).write_text("x")
    assert sorted(fc.remove_temporaries(tmp_path)) == sorted(own)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)
