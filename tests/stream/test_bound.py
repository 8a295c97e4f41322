"""The stream store's bound: a batch's bytes known before the target runs (equal to a real batch's),
auto = --prefetch + 1 batches within the free room, a given bound smaller than one batch refused."""

import math

import pytest
import torch

from spec_cli.batch import batch_nbytes
from spec_cli.draft.contract import TargetField
from spec_cli.errors import ConfigError
from spec_cli.options import parse_size
from spec_cli.stream import FolderStore, MemoryStore, Producer, free_room, store_bound
from spec_cli.stream.bound import SAMPLE_OVERHEAD
from spec_cli.stream.store import tensor_bytes
from spec_cli.targets.hf_backend import HFTargetBackend
from tests.serve.harness import draft_vocab, random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

GiB = 1 << 30
LLAMA_8B = dict(
    hidden=4096, aux_layers=3, draft_vocab=32000, target_dtype=torch.bfloat16
)  # Llama-3.1-8B


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_batch_holds_the_bytes_the_estimate_says(tiny_llama_dir, tmp_path, dtype):
    backend = HFTargetBackend(tiny_llama_dir, None, device="cpu", dtype=dtype)
    backend.set_vocab_mapping(draft_vocab(64))
    H, n_aux = backend.info["hidden_size"], len(backend.aux_layers)
    ids, am, lm = random_batch(B=3, T=17, seed=1)
    packed = {
        "input_ids": ids[:1],
        "attention_mask": torch.ones_like(ids[:1]),
        "loss_mask": lm[:1],
        "seq_lens": torch.tensor([[5, 8, 4]]),
    }
    doubled = TargetField(
        "doubled",
        width=lambda h: 2 * h,
        compute=lambda final, aux, input_ids: torch.cat([final, final], -1),
    )
    cases = [  # (inputs, final hidden, extra fields, rows, length, docs)
        ({"input_ids": ids, "attention_mask": am, "loss_mask": lm}, False, {}, 3, 17, 0),
        (packed, False, {}, 1, 17, 3),
        (
            {"input_ids": ids, "attention_mask": am, "loss_mask": lm},
            True,
            {"doubled": doubled},
            3,
            17,
            0,
        ),
    ]
    try:
        for inputs, final, extras, rows, length, docs in cases:
            backend.keep_final_hidden, backend.extra_fields = final, extras
            batch = backend.generate_batch(**inputs)
            want = batch_nbytes(
                rows,
                length,
                H,
                n_aux,
                64,
                backend.dtype,
                final,
                tuple(f.width(H) for f in extras.values()),
                docs,
            )
            assert tensor_bytes(batch.tensors()) == want  # in memory: exactly the estimate
            with FolderStore(
                tmp_path / f"s-{docs}-{final}"
            ) as folder:  # a file: the tensors and a header
                in_file = Producer(backend, folder, "r" * 12, "f" * 64).publish(10**8, batch).nbytes
            assert want < in_file <= want + SAMPLE_OVERHEAD
            with MemoryStore(max_bytes=store_bound(None, want, 1).max_bytes) as memory:
                memory.put("b", batch.tensors())  # auto's one batch holds it
    finally:
        backend.close()


def test_auto_holds_prefetch_plus_one_8b_batches_over_4_gib_each():
    batch = batch_nbytes(1, 32768, **LLAMA_8B)
    assert batch > 4 * GiB  # the old default, 4G, could not hold one
    one = batch + SAMPLE_OVERHEAD
    bound = store_bound(None, batch, 3)  # free room unknown
    assert bound.max_bytes == 3 * one and bound.source == f"auto: 3 batches of {one / GiB:.2f} GiB"
    assert store_bound(None, batch, 3, free=64 * GiB).max_bytes == 3 * one  # room for 3
    lowered = store_bound(None, batch, 3, free=10 * GiB, where="host memory")
    assert (
        lowered.max_bytes == one
        and "lowered from 3" in lowered.source
        and "host memory" in lowered.source
    )
    with pytest.raises(
        ConfigError, match="more than the stream store may take of host memory"
    ) as refused:
        store_bound(None, batch, 3, free=6 * GiB, where="host memory")
    assert "--batch-tokens" in refused.value.hint


def test_a_given_bound_smaller_than_one_batch_is_refused_with_the_size_that_would_do():
    batch = batch_nbytes(1, 32768, **LLAMA_8B)
    with pytest.raises(
        ConfigError, match=r"--stream-max-bytes 4\.00 GiB is smaller than one batch"
    ) as refused:
        store_bound(4 * GiB, batch, 3)
    enough = f"{math.ceil((batch + SAMPLE_OVERHEAD) / 2**20)}M"
    assert f"at least {enough}" in refused.value.hint and "--batch-tokens" in refused.value.hint
    given = store_bound(
        parse_size(enough, "--stream-max-bytes"), batch, 3, free=1
    )  # given: free room not asked
    assert given.source == "given: --stream-max-bytes"


def test_the_free_room_is_where_the_samples_live(tmp_path, monkeypatch):
    monkeypatch.delenv(
        "LOCAL_WORLD_SIZE", raising=False
    )  # one process (an in-process vLLM run may leave it set)
    free, where = free_room(
        tmp_path / "not" / "made", torch.device("cpu")
    )  # the store makes the folder
    assert free > 0 and where == f"the disk of {tmp_path / 'not' / 'made'}"
    free, where = free_room(None, torch.device("cpu"))
    assert free > 0 and where == "host memory"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: the machine's ranks each have a store
    assert free_room(None, torch.device("cpu"))[1] == "host memory (a 1/4 share: 4 ranks)"


def test_on_a_gpu_the_room_leaves_out_what_the_target_will_take(monkeypatch):
    """The room is measured before a live target loads: on a GPU its share (vLLM's --target-memory of
    the card, or its weights for transformers) is taken off first. An 80 GB card, vLLM at 0.5, batches
    of 32k tokens of an 8B target: 3 batches fit the empty card's 3/4, not what vLLM leaves."""
    from types import SimpleNamespace

    from spec_cli.trainer.sources import _stream_bound

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GiB, 80 * GiB))
    cfg = SimpleNamespace(
        draft=SimpleNamespace(algorithm="eagle3"),
        data=SimpleNamespace(pack=False, remote=None),
        runtime=SimpleNamespace(stream_dir=None, stream_max_bytes=None, prefetch=2),
    )
    tokens = SimpleNamespace(lengths=torch.tensor([32768]))
    one = batch_nbytes(1, 32768, **LLAMA_8B) + SAMPLE_OVERHEAD

    def bound(on_device):
        target = SimpleNamespace(
            hidden_size=4096, aux_layers=[2, 16, 29], dtype=torch.bfloat16, on_device=on_device
        )
        return _stream_bound(
            cfg,
            target,
            SimpleNamespace(draft_vocab_size=32000),
            tokens,
            [[0]],
            torch.device("cuda"),
        )

    assert bound(0).max_bytes == 3 * one
    after_vllm = bound(40 * GiB)  # 0.75 * (80 - 40) GiB = 30 GiB: 6 batches' worth, 3 wanted
    assert after_vllm.max_bytes == 3 * one
    tight = bound(70 * GiB)  # 7.5 GiB of room: one batch
    assert tight.max_bytes == one and "less the target's 70.00 GiB" in tight.source
