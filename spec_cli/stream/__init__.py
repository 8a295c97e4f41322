"""Streaming supervision for online training: the target runs ahead of the trainer, bounded.

store.py     FeatureStore: samples bounded by count and bytes (MemoryStore, FolderStore)
producer.py  Producer: backend -> store, returns a tensor-free SampleRef
loader.py    StreamLoader: producer threads ahead of the trainer; refs -> TargetBatch, in order
bound.py     store_bound: spec train's byte bound, sized from the run's largest batch
"""

from spec_cli.stream.bound import StoreBound, free_room, store_bound
from spec_cli.stream.loader import StreamLoader, load, new_run_id, report_rows
from spec_cli.stream.producer import Producer, SampleRef, SerializedBackend
from spec_cli.stream.store import (
    FeatureStore,
    FolderStore,
    MemoryStore,
    SampleTooLargeError,
    StoreClosedError,
    StoreError,
    StoreFullError,
)

__all__ = [
    "FeatureStore",
    "FolderStore",
    "MemoryStore",
    "Producer",
    "SampleRef",
    "SampleTooLargeError",
    "SerializedBackend",
    "StoreBound",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StreamLoader",
    "free_room",
    "load",
    "new_run_id",
    "report_rows",
    "store_bound",
]
