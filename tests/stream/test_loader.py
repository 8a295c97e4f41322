"""Producer + loader: streamed batches are the in-process (and remote) batches bit for bit; order,
look-ahead, errors and shutdown; nothing is left in the store or the folder."""

import threading
import time

import pytest
import torch

from spec_cli.stream import (
    FolderStore,
    MemoryStore,
    Producer,
    SampleRef,
    SerializedBackend,
    StoreClosedError,
    StreamLoader,
    load,
)
from tests.serve.harness import draft_vocab, load_backend, random_batch, start_server
from tests.stream.fakes import FakeBackend, assert_same_batch, inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["memory", "folder"])
def make_store(request, tmp_path):
    folder = tmp_path / "stream"

    def make(**bounds):
        return MemoryStore(**bounds) if request.param == "memory" else FolderStore(folder, **bounds)

    make.folder = folder
    return make


@pytest.fixture(scope="module")
def local(tiny_llama_dir):
    backend = load_backend(tiny_llama_dir)
    backend.set_vocab_mapping(draft_vocab())
    yield backend
    backend.close()


def hf_inputs(i: int) -> dict:
    """Batch i: plain rows of varying shapes, every third one packed (block-causal documents)."""
    if i % 3 == 2:
        ids = torch.randint(5, 400, (1, 24), generator=torch.Generator().manual_seed(i))
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids),
            "seq_lens": torch.tensor([[9, 11, 4]]),
        }
    ids, am, lm = random_batch(B=1 + i % 3, T=6 + 3 * i, seed=i)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("spec-stream-")]


def test_streamed_batches_equal_in_process_batches(local, make_store):
    store = make_store(max_samples=3, max_bytes=1 << 26)
    shared = SerializedBackend(local)  # the producer thread and this one take turns with the model
    producer = Producer(shared, store, "run0")
    with StreamLoader(producer, hf_inputs, 0, 7, prefetch=2) as loader:
        for i, batch in enumerate(loader):
            assert_same_batch(batch, shared.generate_batch(**hf_inputs(i)))
        report = loader.report()
    assert (report["produced"], report["consumed"], report["samples"]) == (7, 7, 0)
    assert 0 < report["peak_samples"] <= 3 and report["evicted"] == 0
    assert not make_store.folder.exists() and stream_threads() == []


def test_remote_streamed_batches_equal_in_process_batches(tiny_llama_dir, local, tmp_path):
    from spec_cli.serve.client import RemoteBackend

    server = start_server(load_backend(tiny_llama_dir), tiny_llama_dir)
    try:
        remote = RemoteBackend(server.url)
        remote.set_vocab_mapping(draft_vocab())
        producer = Producer(remote, FolderStore(tmp_path / "s", max_samples=4), "remote")
        with StreamLoader(producer, hf_inputs, 0, 6, prefetch=3, workers=3) as loader:
            for i in range(6):
                assert_same_batch(loader.get(i), local.generate_batch(**hf_inputs(i)))
        remote.close()
    finally:
        server.stop(grace=5)
        server.logic.backend.close()
    assert not (tmp_path / "s").exists()


def test_a_produced_ref_is_tensor_free_and_a_dropped_one_is_evicted():
    store = MemoryStore()
    producer = Producer(FakeBackend(), store, "r1")
    refs = [producer.produce(i, **inputs(i)) for i in range(3)]
    ref = refs[1]
    assert ref.run_id == "r1" and ref.index == 1 and ref.target_version == "fake-target"
    assert ref.shapes["aux_hidden"] == [2, 12, 24] and ref.dtypes["aux_hidden"] == "bfloat16"
    assert ref.nbytes > 0 and store.health()["bytes"] == sum(r.nbytes for r in refs)
    assert not any(isinstance(v, torch.Tensor) for v in ref.to_dict().values())
    assert SampleRef.from_dict(ref.to_dict()) == ref
    producer.discard(refs[0])  # a ref that will never be consumed
    assert_same_batch(load(store, refs[2], "cpu"), FakeBackend().generate_batch(**inputs(2)))
    health = store.health()
    assert health["samples"] == 1 and health["evicted"] == 1 and health["released"] == 1
    store.close()
    assert store.health()["samples"] == 0


def test_producers_stay_prefetch_batches_ahead_and_put_in_order():
    backend = FakeBackend(delay=0.01)
    store = MemoryStore(max_samples=2)
    with StreamLoader(
        Producer(backend, store, "w"), inputs, 5, 15, prefetch=1, workers=3
    ) as loader:
        for i in range(5, 15):
            time.sleep(0.02)  # the trainer is slower: producers wait for it
            assert_same_batch(loader.get(i), FakeBackend().generate_batch(**inputs(i)))
            assert max(backend.calls) <= i + 1  # never more than --prefetch ahead
    assert sorted(backend.calls) == list(range(5, 15))  # each batch once, from the resume point
    assert store.health()["peak_samples"] <= 2


def test_a_producer_error_reaches_the_trainer_at_its_batch(make_store):
    store = make_store(max_samples=4)
    loader = StreamLoader(
        Producer(FakeBackend(fail_at=4), store, "e"), inputs, 0, 10, prefetch=3, workers=2
    )
    try:
        for i in range(4):  # the batches before the failure still arrive
            assert_same_batch(loader.get(i), FakeBackend().generate_batch(**inputs(i)))
        with pytest.raises(RuntimeError, match="failed on batch 4"):
            loader.get(4)
    finally:
        loader.close()
    assert store.health()["samples"] == 0 and not make_store.folder.exists()
    assert stream_threads() == []


def test_a_sample_too_large_for_the_bound_fails_the_run_instead_of_hanging():
    from spec_cli.stream import SampleTooLargeError

    loader = StreamLoader(Producer(FakeBackend(), MemoryStore(max_bytes=100), "big"), inputs, 0, 3)
    with loader, pytest.raises(SampleTooLargeError):
        loader.get(0)


def test_closing_mid_run_stops_producers_and_leaves_nothing(make_store):
    """Producers blocked on the bound, refs waiting for the trainer, a target call in flight: close()
    stops them all and the store (and its folder) ends empty."""
    backend = FakeBackend(delay=0.02)
    store = make_store(max_samples=3)
    loader = StreamLoader(Producer(backend, store, "abort"), inputs, 0, 100, prefetch=6, workers=3)
    loader.get(0)
    time.sleep(0.3)  # producers fill the store and block on its bound
    assert store.health()["put_waits"] > 0
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 5
    report = loader.report()
    assert report["samples"] == 0 and report["bytes"] == 0 and report["evicted"] >= 3
    assert report["consumed"] == 1 and report["closed"]
    assert not make_store.folder.exists() and stream_threads() == []
    with pytest.raises(StoreClosedError):
        loader.get(1)
    loader.close()


def test_batches_are_asked_for_in_order():
    with StreamLoader(Producer(FakeBackend(), MemoryStore(), "o"), inputs, 3, 6) as loader:
        with pytest.raises(RuntimeError, match="3 next"):
            loader.get(4)
        assert [int(b.input_ids[0, 0]) for b in loader] == [3, 4, 5]
        with pytest.raises(RuntimeError, match="asked for 6"):
            loader.get(6)
