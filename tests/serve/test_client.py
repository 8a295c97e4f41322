"""The client (RemoteBackend) against real servers on 127.0.0.1: the same tensors and the same trained
weights as the in-process target; clear errors when a server differs, refuses, hangs or dies."""

import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from spec_cli.batch import TargetBatch
from spec_cli.cli import main
from spec_cli.serve.client import RemoteBackend, RemoteError, RemoteMismatchError
from spec_cli.serve.server import Limits
from spec_cli.stages import train as stage
from tests import tiny
from tests.conftest import write_jsonl
from tests.serve.harness import ServerProcess, draft_vocab, load_backend, random_batch, start_server

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    """Two servers, each with its own copy of the target."""
    handles = [
        start_server(load_backend(tiny_llama_dir), tiny_llama_dir, token="tok") for _ in range(2)
    ]
    yield handles
    for h in handles:
        h.stop(grace=5)
        h.logic.backend.close()


def assert_same_batch(got: TargetBatch, want: TargetBatch):
    want_t, got_t = want.tensors(), got.tensors()
    assert set(got_t) == set(want_t)
    for name, t in want_t.items():
        assert got_t[name].dtype == t.dtype and torch.equal(got_t[name], t), name


def count_calls(monkeypatch, handle) -> list:
    calls = []
    real = handle.logic.backend.generate_batch
    monkeypatch.setattr(
        handle.logic.backend, "generate_batch", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    return calls


def test_remote_supervision_equals_in_process(servers, local, monkeypatch):
    calls = [count_calls(monkeypatch, h) for h in servers]
    remote = RemoteBackend([h.url for h in servers], token="tok")
    assert remote.info == {k: local.info[k] for k in remote.info}
    assert torch.equal(remote.get_input_embeddings(), local.get_input_embeddings())
    remote.set_vocab_mapping(draft_vocab())
    requests = [
        random_batch(B, T, seed) for seed, (B, T) in enumerate([(3, 20), (1, 7), (4, 33), (2, 2)])
    ]
    for ids, am, lm in requests:  # synchronous
        assert_same_batch(remote.generate_batch(ids, am, lm), local.generate_batch(ids, am, lm))
    with ThreadPoolExecutor(3) as pool:  # as the trainer's producer threads: 3 requests in flight
        futures = [pool.submit(remote.generate_batch, *requests[i % 4]) for i in range(12)]
        for i, future in enumerate(futures):
            assert_same_batch(future.result(timeout=60), local.generate_batch(*requests[i % 4]))
    packed = torch.randint(5, 400, (1, 30), generator=torch.Generator().manual_seed(9))
    seq_lens = torch.tensor([[11, 12, 7]])
    ones = torch.ones_like(packed)
    assert_same_batch(
        remote.generate_batch(packed, ones, ones, seq_lens=seq_lens),
        local.generate_batch(packed, ones, ones, seq_lens=seq_lens),
    )
    assert all(len(c) >= 3 for c in calls), [len(c) for c in calls]  # both servers did work
    remote.close()


def test_a_different_target_is_a_clear_error(servers, tiny_llama_dir, local):
    url = servers[0].url
    with pytest.raises(RemoteMismatchError, match="different target fingerprint") as err:
        RemoteBackend(url, token="tok", expect={"target_fingerprint": "0123456789abcdef"})
    assert "spec serve-target" in err.value.hint
    with pytest.raises(RemoteMismatchError, match="different aux layers"):
        RemoteBackend(url, token="tok", expect={"aux_layers": [1, 2, 5]})
    same = {k: local.info[k] for k in ("target_fingerprint", "tokenizer_fingerprint", "aux_layers")}
    ok = RemoteBackend(url, token="tok", expect=same)
    ok.close()
    other = start_server(
        load_backend(tiny_llama_dir, aux_layers=[1, 2, 5]), tiny_llama_dir, token="tok"
    )
    try:
        with pytest.raises(RemoteMismatchError, match="disagree on aux layers"):
            RemoteBackend([url, other.url], token="tok")
    finally:
        other.stop(grace=5)
        other.logic.backend.close()


def test_refusals_are_clear_errors(servers, tiny_llama_dir):
    with pytest.raises(RemoteError, match="refused the token") as err:
        RemoteBackend(servers[0].url, token="nope")
    assert "--token" in err.value.hint
    for bad in ("ftp://127.0.0.1:1", "http://127.0.0.1:80/v1", "http://127.0.0.1:99999", ""):
        with pytest.raises(RemoteError):
            RemoteBackend(bad)
    small = start_server(
        load_backend(tiny_llama_dir),
        tiny_llama_dir,
        limits=Limits(max_batch_tokens=64, max_seq_len=16),
    )
    try:
        remote = RemoteBackend(small.url)
        remote.set_vocab_mapping(draft_vocab())
        with pytest.raises(
            RemoteError, match="sequence length 20 exceeds the target server's limit 16"
        ):
            remote.generate_batch(*random_batch(3, 20))
        remote.close()
    finally:
        small.stop(grace=5)
        small.logic.backend.close()


def test_a_server_that_lost_the_vocab_mapping_gets_it_again(servers, local):
    remote = RemoteBackend(servers[0].url, token="tok")
    remote.set_vocab_mapping(draft_vocab())
    servers[0].logic._vocab_maps.clear()  # as after a server restart
    ids, am, lm = random_batch(seed=4)
    assert_same_batch(remote.generate_batch(ids, am, lm), local.generate_batch(ids, am, lm))
    remote.close()


def test_unreachable_and_silent_servers_fail_fast():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(RemoteError, match="cannot be reached .* after 3 attempt"):
        RemoteBackend(f"127.0.0.1:{port}", retries=2, backoff=0.05)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    try:
        with pytest.raises(RemoteError, match="gave no answer to the info request within 1 s"):
            RemoteBackend(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=1)
    finally:
        silent.close()
    assert time.monotonic() - start < 15


@pytest.mark.slow
def test_a_server_killed_mid_run_fails_the_client_clearly(tiny_llama_dir, local):
    proc = ServerProcess(tiny_llama_dir)
    try:
        remote = RemoteBackend(proc.url, retries=1, backoff=0.1, timeout=30)
        remote.set_vocab_mapping(draft_vocab())
        requests = [random_batch(4, 64, seed=s) for s in range(3)]
        with ThreadPoolExecutor(2) as pool:  # two requests in flight
            futures = [pool.submit(remote.generate_batch, *requests[i % 3]) for i in range(12)]
            futures[0].result(timeout=60)
            proc.proc.kill()  # SIGKILL: no goodbye
            start = time.monotonic()
            outcomes = []
            for i, future in enumerate(futures):
                try:
                    assert_same_batch(
                        future.result(timeout=30), local.generate_batch(*requests[i % 3])
                    )
                    outcomes.append("ok")
                except RemoteError as exc:
                    assert "cannot be reached" in str(exc) and "--resume" in exc.hint
                    outcomes.append("error")
        assert "error" in outcomes and time.monotonic() - start < 30
        with pytest.raises(RemoteError, match="cannot be reached"):
            remote.generate_batch(*requests[0])
        remote.close()
    finally:
        proc.kill()


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory, tiny_llama_dir):
    """A peaked tiny target (tiny.peaked_copy), chat data and a vocab map."""
    root = tmp_path_factory.mktemp("remote-train")
    target = tiny.peaked_copy(tiny_llama_dir, root / "peaky-llama")
    rng = random.Random(11)
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(24)])
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(target),
                "-d",
                str(data),
                "--draft-vocab-size",
                "96",
                "-o",
                str(root / "vm.safetensors"),
                "-q",
            ]
        )
        == 0
    )
    return {"target": target, "data": data, "vm": root / "vm.safetensors"}


@pytest.mark.parametrize("pack, prefetch", [(False, 2), (True, 0)])
def test_training_against_a_server_equals_training_in_process(
    train_setup, tmp_path, monkeypatch, pack, prefetch
):
    """With --prefetch N the batches come from N producer threads ahead of the loop (spec_cli/stream,
    a memory store, no stream.json); with 0 each is asked for when the loop needs it."""
    kw = dict(
        vocab_map=train_setup["vm"],
        target=str(train_setup["target"]),
        data=str(train_setup["data"]),
        dtype="fp32",
        ttt_steps=3,
        lr=3e-3,
        max_steps=3,
        log_every=1,
        eval_every=2,
        save_every=3,
        eval_fraction=0.2,
        batch_tokens=256,
        pack=pack,
    )
    live = stage.run(stage.TrainConfig.from_options(output=tmp_path / "live", **kw))
    handle = start_server(load_backend(train_setup["target"]), train_setup["target"])
    calls = count_calls(monkeypatch, handle)
    threads = []  # the client threads that asked for supervision
    real = RemoteBackend.generate_batch
    monkeypatch.setattr(
        RemoteBackend,
        "generate_batch",
        lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k),
    )
    try:
        remote = stage.run(
            stage.TrainConfig.from_options(
                output=tmp_path / "remote",
                prefetch=prefetch,
                **{**kw, "target": None, "remote": handle.url},
            )
        )
    finally:
        handle.stop(grace=5)
        handle.logic.backend.close()
    assert live.steps == remote.steps == 3
    assert len(calls) >= 3  # every batch came from the server
    assert ("spec-stream-0" in threads) == (prefetch > 0)  # (evaluation asks from the main thread)
    assert set(threads) <= {"MainThread", *(f"spec-stream-{k}" for k in range(prefetch))}
    assert (
        remote.stream is None and not (tmp_path / "remote" / "stream.json").exists()
    )  # that is --stream's
    from safetensors.torch import load_file

    from spec_cli.artifacts import checkpoint as ckpt

    a = load_file(str(ckpt.latest_checkpoint(tmp_path / "live") / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(tmp_path / "remote") / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert live.final_eval["loss"] == remote.final_eval["loss"]
