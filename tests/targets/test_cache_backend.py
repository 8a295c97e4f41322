"""The feature-cache backend answers with exactly what precompute stored: each row (or packed document)
is found by its tokens whatever batch it is in, its stored features are laid in place, and the
supervision is computed from them as the live backend computes it."""

import pytest
import torch

from spec_cli.data.batching import collate, collate_packed
from spec_cli.errors import ArtifactError
from spec_cli.targets.cache_backend import CacheBackend
from tests.artifacts.caches import H, V, random_samples, write_cache

SHARDS = [[[0, 1], [2]], [[3, 4, 5]]]  # shard -> batches -> sample indices
ORDER = [i for shard in SHARDS for batch in shard for i in batch]  # cache order


@pytest.fixture(params=["hidden", "probs"])
def cache(request, tmp_path):
    samples = random_samples(6, seed=1)
    stored = write_cache(tmp_path / "cache", samples, SHARDS, encoding=request.param)
    backend = CacheBackend(tmp_path / "cache")
    yield {"backend": backend, "samples": samples, "encoding": request.param, **stored}
    backend.close()


def stored_features(cache, sample: int) -> dict:
    """The stored per-token tensors of one sample, read back from what write_cache kept."""
    for shard, batches in enumerate(SHARDS):
        order = [i for batch in batches for i in batch]
        if sample in order:
            start = sum(len(cache["samples"][i]) for i in order[: order.index(sample)])
            end = start + len(cache["samples"][sample])
            tensors = cache["shards"][shard]
            return {
                k: v[start:end]
                for k, v in tensors.items()
                if v.shape[0] == tensors["input_ids"].shape[0]
            }
    raise KeyError(sample)


def expected_target_p(cache, features: dict) -> torch.Tensor:
    """target_p per token from the stored features alone: stored (probs), or the softmax of the stored
    final hidden state through the stored draft-vocab head (hidden)."""
    if cache["encoding"] == "probs":
        return features["target_p"]
    return torch.softmax(features["final_hidden"] @ cache["head"]["lm_head_selected"].T, dim=-1)


def test_rows_in_any_batch_get_the_features_stored_for_their_tokens(cache):
    backend, samples = cache["backend"], cache["samples"]
    rows = [4, 0, 2]  # not a batch precompute made, nor in its order
    ids, am, lm = collate(backend.tokens(), [ORDER.index(i) for i in rows])
    batch = backend.generate_batch(ids, am, lm)
    for row, sample in enumerate(rows):
        n, got = len(samples[sample]), stored_features(cache, sample)
        assert torch.equal(ids[row, :n], samples[sample]) and torch.equal(
            lm[row, :n], got["loss_mask"].long()
        )
        assert torch.equal(batch.aux_hidden[row, :n], got["aux_hidden"])  # position-aligned
        assert not batch.aux_hidden[row, n:].any()  # padding carries no state
        # shifted by one: position t learns the target's distribution for token t+1
        assert torch.equal(batch.target_ids[row, : n - 1], got["argmax"][1:].long())
        torch.testing.assert_close(batch.target_p[row, : n - 1], expected_target_p(cache, got)[1:])
        assert torch.equal(batch.input_ids[row, : n - 1], samples[sample][1:])
        assert torch.equal(batch.loss_mask[row, : n - 1], got["loss_mask"][1:].long())
        assert not batch.loss_mask[row, n - 1 :].any() and not batch.target_p[row, n - 1 :].any()
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[cache["selected"]] = True
        assert torch.equal(
            batch.position_mask[row, : n - 1],
            t2d[got["argmax"][1:].long()] & got["loss_mask"][1:].bool(),
        )


def test_packed_documents_are_found_one_by_one(cache):
    backend = cache["backend"]
    docs = [5, 1, 3]
    ids, am, lm, seq_lens = collate_packed(backend.tokens(), [ORDER.index(i) for i in docs])
    batch = backend.generate_batch(ids, am, lm, seq_lens=seq_lens)
    features = [stored_features(cache, d) for d in docs]
    assert torch.equal(batch.aux_hidden[0], torch.cat([f["aux_hidden"] for f in features]))
    # each document's own next-token targets; its last token predicts nothing (the next one starts
    # another document)
    target_p = torch.cat(
        [
            torch.cat([p[1:], torch.zeros_like(p[:1])])
            for p in (expected_target_p(cache, f) for f in features)
        ]
    )
    torch.testing.assert_close(batch.target_p[0, : len(target_p)], target_p)
    assert torch.equal(batch.seq_lens, seq_lens)


def test_tokens_plan_and_head_are_the_caches_own(cache):
    backend, samples = cache["backend"], cache["samples"]
    tokens = backend.tokens()
    assert len(tokens) == 6
    for gid, sample in enumerate(ORDER):
        ids, mask = tokens.sample(gid)
        assert torch.equal(ids.long(), samples[sample]) and torch.equal(
            mask, cache["loss_masks"][sample]
        )
    assert torch.equal(tokens.source_index, torch.tensor(ORDER))
    assert backend.plan() == [[0, 1], [2], [3, 4, 5]]
    assert torch.equal(backend.get_input_embeddings(), cache["head"]["embed_tokens"])
    head = backend.get_output_head()
    assert torch.equal(head["lm_head_selected"], cache["head"]["lm_head_selected"])
    assert torch.equal(head["final_norm"], cache["head"]["final_norm"])
    assert backend.info["hidden_size"] == H and backend.info["aux_layers"] == [1, 3, 4]


def test_a_sample_or_vocab_map_the_cache_was_not_made_with_is_refused(cache):
    backend = cache["backend"]
    backend.set_vocab_mapping(cache["selected"])  # the same map: accepted
    with pytest.raises(ArtifactError, match="vocab map differs"):
        backend.set_vocab_mapping(cache["selected"][:-1])
    ids, am, lm = collate(backend.tokens(), [0])
    ids[0, 1] = (ids[0, 1] + 1) % V  # one token changed: not a stored sample
    with pytest.raises(ArtifactError, match="not in the feature cache"):
        backend.generate_batch(ids, am, lm)
