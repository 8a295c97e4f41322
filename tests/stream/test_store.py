"""The feature store: round trips, bounds that block and wake, close, and the byte bound under a slow
consumer, in memory and in a folder."""

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from spec_cli.errors import ConfigError
from spec_cli.stream.store import (
    FolderStore,
    MemoryStore,
    SampleTooLargeError,
    StoreClosedError,
    StoreError,
    StoreFullError,
)


@pytest.fixture(params=["memory", "folder"])
def make_store(request, tmp_path):
    folder = tmp_path / "stream"

    def make(**bounds):
        return MemoryStore(**bounds) if request.param == "memory" else FolderStore(folder, **bounds)

    make.kind, make.folder = request.param, folder
    return make


def tensors(n: int = 64, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, generator=gen),
        "h": torch.randn(2, n, generator=gen).to(torch.bfloat16),
        "ids": torch.randint(0, 100, (n,), generator=gen),
        "mask": torch.rand(n, generator=gen) > 0.5,
    }


def size_of(make, **bounds) -> int:
    """Bytes one `tensors()` sample takes in this kind of store."""
    store = make(**bounds)
    n = store.put("probe", tensors())
    store.close()
    return n


def left_in(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


def blocked_put(store, sample_id: str, **kw) -> tuple[threading.Thread, list]:
    result: list = []

    def put():
        try:
            result.append(store.put(sample_id, tensors(seed=9), **kw))
        except Exception as exc:  # noqa: BLE001
            result.append(exc)

    thread = threading.Thread(target=put, daemon=True)
    thread.start()
    return thread, result


def test_round_trip_keeps_dtypes_values_and_metadata(make_store):
    store = make_store(max_samples=4)
    sent = tensors()
    nbytes = store.put("run-1", sent, {"index": 1, "shapes": {"x": [64]}})
    assert nbytes > 0 and len(store) == 1 and store.nbytes == nbytes
    sample = store.get("run-1")
    assert sample.metadata == {"index": 1, "shapes": {"x": [64]}}
    for name, t in sent.items():
        assert sample.tensors[name].dtype == t.dtype and torch.equal(sample.tensors[name], t), name
    store.release("run-1")
    with pytest.raises(StoreError, match="no sample"):
        store.get("run-1")
    with pytest.raises(StoreError, match="to release"):
        store.release("run-1")
    store.put("run-2", sent)
    assert store.evict("run-2") and not store.evict("run-2")
    health = store.health()
    assert health["samples"] == 0 and health["bytes"] == 0
    assert (health["puts"], health["released"], health["evicted"]) == (2, 1, 1)
    assert health["peak_samples"] == 1 and health["peak_bytes"] == nbytes
    store.close()
    assert left_in(make_store.folder) == []


def test_memory_bytes_count_a_shared_buffer_once():
    buffer = torch.zeros(1000)
    store = MemoryStore()
    assert store.put("a", {"x": buffer[:10], "y": buffer[500:]}) == 4000
    assert store.put("b", {"x": torch.zeros(10), "y": torch.zeros(5, dtype=torch.float64)}) == 80


def test_a_full_store_blocks_until_a_release_and_can_refuse(make_store):
    store = make_store(max_samples=2)
    store.put("a", tensors())
    store.put("b", tensors())
    with pytest.raises(StoreFullError, match="full"):
        store.put("c", tensors(), block=False)
    t0 = time.monotonic()
    with pytest.raises(StoreFullError):
        store.put("c", tensors(), timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 2
    thread, result = blocked_put(store, "c")
    time.sleep(0.2)
    assert thread.is_alive() and result == []  # waiting on the bound
    store.release("a")
    thread.join(5)
    assert not thread.is_alive() and isinstance(result[0], int)
    assert sorted(s for s in ("a", "b", "c") if _has(store, s)) == ["b", "c"]
    health = store.health()
    assert health["put_waits"] == 2 and health["put_wait_s"] > 0.15 and health["peak_samples"] == 2
    store.close()
    assert left_in(make_store.folder) == []


def _has(store, sample_id: str) -> bool:
    try:
        store.get(sample_id)
        return True
    except StoreError:
        return False


def test_close_wakes_a_blocked_put_and_frees_everything(make_store):
    store = make_store(max_samples=1)
    store.put("a", tensors())
    thread, result = blocked_put(store, "b")
    time.sleep(0.1)
    assert thread.is_alive()
    t0 = time.monotonic()
    store.close()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - t0 < 2
    assert isinstance(result[0], StoreClosedError)
    assert len(store) == 0 and store.health()["evicted"] == 1
    assert left_in(make_store.folder) == []
    with pytest.raises(StoreClosedError):
        store.put("c", tensors())
    store.close()  # twice is fine


def test_a_sample_larger_than_max_bytes_is_an_error_not_a_wait(make_store):
    one = size_of(make_store)
    store = make_store(max_bytes=one - 1)
    t0 = time.monotonic()
    with pytest.raises(SampleTooLargeError, match="could never fit") as info:
        store.put("a", tensors())
    assert time.monotonic() - t0 < 1 and "--stream-max-bytes" in info.value.hint
    assert len(store) == 0
    store.close()


def test_bad_bounds_and_ids_are_refused(tmp_path):
    with pytest.raises(ConfigError):
        MemoryStore(max_bytes=0)
    with pytest.raises(ConfigError):
        FolderStore(tmp_path / "s", max_samples=0)
    store = MemoryStore()
    with pytest.raises(StoreError, match="bad sample id"):
        store.put("../x", tensors())
    store.put("a", tensors())
    with pytest.raises(StoreError, match="already"):
        store.put("a", tensors())


def test_a_slow_consumer_never_lets_the_store_exceed_max_bytes(make_store):
    """Three producers of samples of different sizes, a consumer slower than them: the bytes held,
    sampled independently all along (the folder's real file sizes), never pass the bound."""
    one = size_of(make_store)
    bound = int(2.5 * one)
    store = make_store(max_bytes=bound)
    n, seen, done = 18, [], threading.Event()

    def held() -> int:
        if make_store.kind == "folder":
            total = 0
            for name in left_in(make_store.folder):
                try:
                    total += (make_store.folder / name).stat().st_size
                except FileNotFoundError:
                    pass
            return total
        return store.nbytes

    def watch():
        while not done.is_set():
            seen.append(held())
            time.sleep(0.001)

    def produce(k: int):
        for i in range(k, n, 3):
            store.put(f"s{i:03d}", tensors(n=32 + 16 * (i % 3), seed=i))

    threads = [threading.Thread(target=produce, args=(k,), daemon=True) for k in range(3)]
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for t in threads:
        t.start()
    consumed = 0
    deadline = time.monotonic() + 20
    while consumed < n and time.monotonic() < deadline:
        time.sleep(0.02)  # the slow consumer
        for i in range(n):
            if _has(store, f"s{i:03d}"):
                store.take(f"s{i:03d}")
                consumed += 1
                break
    for t in threads:
        t.join(5)
    done.set()
    watcher.join(5)
    health = store.health()
    assert consumed == n and health["puts"] == n and health["released"] == n
    assert health["put_waits"] > 0  # the bound did hold producers back
    assert health["peak_bytes"] <= bound and max(seen) <= bound, (
        health["peak_bytes"],
        max(seen),
        bound,
    )
    assert health["peak_bytes"] > one  # and it was used
    store.close()
    assert left_in(make_store.folder) == []
