"""The tensor plane (spec_cli/serve/plane.py): supervision over torch.distributed send/recv (gloo here)
after a JSON header, bit-identical to the HTTP body and to the in-process target; the fallback to HTTP
bodies, chosen per server and said in `transport`; a server killed mid-transfer."""

import os
import re
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from spec_cli.serve import plane, wire
from spec_cli.serve.client import RemoteBackend, RemoteError
from spec_cli.serve.plane import PlaneHost
from tests.serve.harness import ServerProcess, draft_vocab, load_backend, random_batch, start_server
from tests.serve.test_client import assert_same_batch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def planes(tiny_llama_dir):
    """A server with a tensor plane and one without (the same target)."""
    with_plane = start_server(
        load_backend(tiny_llama_dir),
        tiny_llama_dir,
        token="tok",
        plane=PlaneHost("127.0.0.1", 0, timeout=20),
    )
    without = start_server(load_backend(tiny_llama_dir), tiny_llama_dir, token="tok")
    yield with_plane, without
    for h in (with_plane, without):
        h.stop(grace=5)
        h.logic.backend.close()


def sent_bodies(monkeypatch, handle) -> list:
    """The generate answers' content types (JSON: tensors over the plane; safetensors: in the body)."""
    seen = []
    real = handle.logic.generate
    monkeypatch.setattr(
        handle.logic, "generate", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    )
    handle.logic.routes["/v1/generate"] = ("POST", handle.logic.generate)
    return seen


def test_the_plane_carries_the_same_tensors_as_the_body_and_the_target(planes, local, monkeypatch):
    with_plane, without = planes
    answers = sent_bodies(monkeypatch, with_plane)
    over_plane = RemoteBackend(with_plane.url, token="tok")
    over_http = RemoteBackend(with_plane.url, token="tok", tensor_plane=False)
    old_server = RemoteBackend(without.url, token="tok")
    assert over_plane.transport == f"{with_plane.url}: tensor plane (gloo, after a JSON header)"
    assert over_http.transport == f"{with_plane.url}: HTTP bodies (--no-tensor-plane)"
    assert old_server.transport == f"{without.url}: HTTP bodies (the server offers no tensor plane)"
    for remote in (over_plane, over_http, old_server):
        remote.keep_final_hidden = True  # every field a trainer may ask for
        remote.set_vocab_mapping(draft_vocab())
    local.keep_final_hidden = True
    packed = torch.randint(5, 400, (1, 30), generator=torch.Generator().manual_seed(9))
    ones = torch.ones_like(packed)
    requests = [
        (random_batch(B, T, seed), {}) for seed, (B, T) in enumerate([(3, 20), (1, 7), (4, 33)])
    ]
    requests.append(((packed, ones, ones), {"seq_lens": torch.tensor([[11, 12, 7]])}))
    try:
        tensor_bytes = []
        for args, kw in requests:
            want = local.generate_batch(*args, **kw)
            tensor_bytes.append(sum(t.numel() * t.element_size() for t in want.tensors().values()))
            via_plane = over_plane.generate_batch(*args, **kw)
            assert_same_batch(via_plane, want)
            assert_same_batch(over_http.generate_batch(*args, **kw), via_plane)
            assert_same_batch(old_server.generate_batch(*args, **kw), via_plane)
        assert over_plane.received == {"plane": 4, "http": 0}
        assert over_http.received == old_server.received == {"plane": 0, "http": 4}
        kinds = [a.content_type for a in answers]
        assert (
            kinds == [wire.JSON_TYPE, wire.TENSOR_TYPE] * 4
        )  # the plane's answers carry no tensor bytes
        assert all(a.nbytes < 1500 for a in answers[::2])
        assert all(a.nbytes > n for a, n in zip(answers[1::2], tensor_bytes))
        with ThreadPoolExecutor(
            3
        ) as pool:  # producer threads: a channel each, three transfers at once
            futures = [
                pool.submit(over_plane.generate_batch, *requests[i % 3][0]) for i in range(9)
            ]
            for i, future in enumerate(futures):
                assert_same_batch(
                    future.result(timeout=60), local.generate_batch(*requests[i % 3][0])
                )
        assert over_plane.received["plane"] == 13 and len(over_plane._channels) == 4
    finally:
        local.keep_final_hidden = False
        for remote in (over_plane, over_http, old_server):
            remote.close()
    time.sleep(0.2)
    assert with_plane.logic.plane._channels == {}  # the goodbye closed the client's channels


def test_a_lost_channel_is_reopened_and_a_failing_plane_falls_back_to_http(planes, local):
    with_plane = planes[0]
    remote = RemoteBackend(with_plane.url, token="tok", timeout=2, backoff=0.05)
    remote.set_vocab_mapping(draft_vocab())
    ids, am, lm = random_batch(seed=3)
    want = local.generate_batch(ids, am, lm)
    try:
        with_plane.logic.plane.close()  # as after a restart: the server knows none of our channels
        assert_same_batch(remote.generate_batch(ids, am, lm), want)  # 409 "plane": a new channel
        assert remote.received == {"plane": 1, "http": 0} and remote.servers[0].plane_failures == 0
        real = plane.Channel.send

        def broken(
            self, tensors, tag
        ):  # not a PlaneError: whatever fails, the server drops the channel
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        plane.Channel.send = broken  # the server's sends fail (it stays up): the client's receive
        try:  # times out (its --timeout, 2 s here), and each retry opens a new channel
            start = time.monotonic()
            for _ in range(2):
                assert_same_batch(remote.generate_batch(ids, am, lm), want)
            assert time.monotonic() - start < 15
        finally:
            plane.Channel.send = real
        assert remote.servers[0].plane_off == "3 transfers over its tensor plane failed"
        assert with_plane.logic.plane._channels == {}  # each failed one closed on the server too
        assert remote.transport.endswith("HTTP bodies (3 transfers over its tensor plane failed)")
        assert remote.received["http"] == 2
    finally:
        remote.close()


def test_plane_answers_are_checked(planes):
    with pytest.raises(wire.WireError, match="unknown dtype"):
        plane.parse_header([["a", "F99", [2]]])
    with pytest.raises(wire.WireError, match="listed twice"):
        plane.parse_header([["a", "F32", [2]], ["a", "F32", [2]]])
    with pytest.raises(wire.WireError, match="shape must be"):
        plane.parse_header([["a", "F32", [-1]]])
    logic = planes[0].logic
    answer = logic.handle(
        "POST", "/v1/plane", {"Authorization": "Bearer tok"}, b'{"backend": "mpi"}'
    )
    assert wire.loads(answer.body()) == {
        "channel": None,
        "reason": "this server runs no mpi tensor plane (it has gloo)",
    }
    refused = logic.handle(
        "POST",
        "/v1/generate",
        {"Authorization": "Bearer tok", "X-Spec-Plane": "nope"},
        wire.encode(
            dict(zip(("input_ids", "attention_mask", "loss_mask"), random_batch()))
        ).tobytes(),
    )
    assert refused.status == 409 and wire.loads(refused.body())["code"] == "plane"


KILLER = textwrap.dedent("""
    import os, sys
    from spec_cli.serve import plane
    real = plane.Channel.send
    def send_half(self, tensors, tag):  # the first tensor goes out, then the process dies
        first = dict(list(tensors.items())[:1])
        real(self, first, tag)
        os._exit(9)
    plane.Channel.send = send_half
    from spec_cli.serve.run import serve
    serve(sys.argv[1], port=0, device="cpu", dtype="fp32")
""")


def test_a_server_killed_mid_transfer_is_a_clear_error_and_a_restarted_one_serves_again(
    tiny_llama_dir, local
):
    dying = ServerProcess(tiny_llama_dir, code=KILLER)
    port = int(dying.url.rsplit(":", 1)[1])
    try:
        remote = RemoteBackend(dying.url, retries=1, backoff=0.2, timeout=30)
        assert "tensor plane (gloo" in remote.transport
        remote.set_vocab_mapping(draft_vocab())
        ids, am, lm = random_batch(4, 64, seed=1)
        start = time.monotonic()
        with pytest.raises(
            RemoteError, match="cannot be reached .*tensor plane|cannot be reached"
        ) as err:
            remote.generate_batch(ids, am, lm)
        assert time.monotonic() - start < 20  # no hang: the receive fails when the peer goes
        assert "--resume" in err.value.hint
        assert dying.proc.wait(timeout=10) == 9
        again = ServerProcess(tiny_llama_dir, port=port)  # a restart on the same address
        try:
            batch = remote.generate_batch(ids, am, lm)  # our vocab is resent, a new channel opened
            assert_same_batch(batch, local.generate_batch(ids, am, lm))
            assert remote.received["plane"] == 1
        finally:
            remote.close()
            again.kill()
    finally:
        dying.kill()


def test_spec_train_takes_the_plane_and_says_so(train_setup, tmp_path, capsys):
    """`spec serve-target` (its tensor plane on by default) and `spec train --remote` through the CLI:
    the log says how the supervision came, and the weights equal those trained from HTTP bodies."""
    from safetensors.torch import load_file

    from spec_cli.artifacts import checkpoint as ckpt
    from spec_cli.cli import main

    server = ServerProcess(train_setup["target"])
    try:
        common = [
            "train",
            "--vocab-map",
            str(train_setup["vm"]),
            "--remote",
            server.url,
            "--data",
            str(train_setup["data"]),
            "--dtype",
            "fp32",
            "--ttt-steps",
            "3",
            "--lr",
            "3e-3",
            "--max-steps",
            "3",
            "--batch-tokens",
            "256",
            "--eval-fraction",
            "0.2",
            "--save-every",
            "3",
        ]
        capsys.readouterr()
        assert main([*common, "-o", str(tmp_path / "plane"), "--prefetch", "2"]) == 0
        said = capsys.readouterr()
        text = " ".join((said.out + said.err).split())
        assert f"remote supervision: {server.url}: tensor plane (gloo, after a JSON header)" in text
        assert (
            found := re.search(r"(\d+) batch\(es\) over the tensor plane, 0 in HTTP bodies", text)
        ) and int(found.group(1)) >= 3
        assert main([*common, "-o", str(tmp_path / "http"), "--no-tensor-plane"]) == 0
        said = capsys.readouterr()
        text = " ".join((said.out + said.err).split())
        assert (
            "HTTP bodies (--no-tensor-plane)" in text
            and "0 batch(es) over the tensor plane" in text
        )
    finally:
        server.kill()
    a = load_file(str(ckpt.latest_checkpoint(tmp_path / "plane") / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(tmp_path / "http") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nccl_is_chosen_only_gpu_to_gpu(monkeypatch):
    """The CUDA choice, emulated: an NCCL channel only when the trainer's device is a GPU and both ends run
    NCCL; batches then land on that GPU (the stream's bound is measured there)."""
    from spec_cli.serve.client import _Server

    monkeypatch.setattr(plane, "backends", lambda: ["gloo", "nccl"])
    gpu_server = PlaneHost("127.0.0.1", 0, timeout=5, device="cuda:0")
    cpu_server = PlaneHost("127.0.0.1", 0, timeout=5, device="cpu")
    assert gpu_server.backends == ["gloo", "nccl"] and cpu_server.backends == ["gloo"]
    offers = {"gpu": gpu_server.info(), "cpu": cpu_server.info()}
    for host in (gpu_server, cpu_server):
        host.close()
    remote = RemoteBackend.__new__(RemoteBackend)
    for trainer, served, want in [
        ("cuda:1", "gpu", "nccl"),
        ("cuda:1", "cpu", "gloo"),
        ("cpu", "gpu", "gloo"),
    ]:
        server = _Server("127.0.0.1:1")
        server.info = {"plane": offers[served]}
        remote.device, remote.servers = torch.device(trainer), [server]
        assert remote._plane_backend(server) == want, (trainer, served)
        assert remote.lands_on == (torch.device(trainer) if want == "nccl" else torch.device("cpu"))
        server.plane_off = "--no-tensor-plane"
        assert remote.lands_on == torch.device("cpu")
    monkeypatch.setattr(plane, "backends", lambda: ["gloo"])  # a trainer without NCCL
    server.plane_off, remote.device = None, torch.device("cuda:0")
    server.info = {"plane": offers["gpu"]}
    assert remote._plane_backend(server) == "gloo"


def test_a_trainer_on_the_servers_own_gpu_takes_gloo(monkeypatch):
    """NCCL cannot pair a GPU with itself: the server offers its GPU's UUID, and a trainer on that same
    GPU (one machine, one card) takes gloo; on another GPU, NCCL."""
    from spec_cli.serve.client import _Server

    monkeypatch.setattr(plane, "backends", lambda: ["gloo", "nccl"])
    uuids = {0: "GPU-aaaa", 1: "GPU-bbbb"}
    monkeypatch.setattr(
        plane, "gpu_identity", lambda d: uuids.get(d.index) if d.type == "cuda" else None
    )
    host = PlaneHost("127.0.0.1", 0, timeout=5, device="cuda:0")
    offer = host.info()
    host.close()
    assert offer["gpu"] == "GPU-aaaa"
    remote = RemoteBackend.__new__(RemoteBackend)
    server = _Server("127.0.0.1:1")
    server.info = {"plane": offer}
    for trainer, want in [("cuda:0", "gloo"), ("cuda:1", "nccl")]:
        remote.device, remote.servers = torch.device(trainer), [server]
        assert remote._plane_backend(server) == want, trainer


def test_a_server_restarted_between_batches_costs_no_try(planes, local):
    """A restarted server knows neither this thread's channel nor its vocab mapping: the next generate
    opens a new channel and resends the mapping (two 409s), even with no retries left for failures."""
    with_plane = planes[0]
    remote = RemoteBackend(with_plane.url, token="tok", retries=0)
    remote.set_vocab_mapping(draft_vocab())
    ids, am, lm = random_batch(seed=5)
    try:
        assert_same_batch(remote.generate_batch(ids, am, lm), local.generate_batch(ids, am, lm))
        with_plane.logic.plane.close()
        with_plane.logic._vocab_maps.clear()
        with_plane.logic._active_vocab = None
        assert_same_batch(remote.generate_batch(ids, am, lm), local.generate_batch(ids, am, lm))
        assert remote.received == {"plane": 2, "http": 0} and remote.servers[0].plane_failures == 0
    finally:
        remote.close()


def test_a_connection_lost_with_a_channel_in_use_drops_that_channel(planes, local, monkeypatch):
    """The server may still send a lost request's tensors into its channel: the retry takes a new one, so
    no answer is matched with another request's tensors."""
    from spec_cli.serve import client as client_module

    with_plane = planes[0]
    remote = RemoteBackend(with_plane.url, token="tok", backoff=0.01)
    remote.set_vocab_mapping(draft_vocab())
    used, real = [], remote._exchange

    def flaky(server, method, path, body, timeout, headers=None):
        if headers and "X-Spec-Plane" in headers:
            used.append(headers["X-Spec-Plane"])
            if len(used) == 1:
                raise client_module._Retry("connection reset by peer")
        return real(server, method, path, body, timeout, headers)

    monkeypatch.setattr(remote, "_exchange", flaky)
    ids, am, lm = random_batch(seed=6)
    try:
        assert_same_batch(remote.generate_batch(ids, am, lm), local.generate_batch(ids, am, lm))
        assert len(used) == 2 and used[0] != used[1] and remote.received["plane"] == 1
    finally:
        remote.close()


class _Work:
    """A posted transfer as NCCL's Work answers: completed after `polls` queries; a failed one reports
    itself completed and raises its error from wait()."""

    def __init__(self, polls=0, error=None):
        self.polls, self.error, self.waited = polls, error, False

    def is_completed(self):
        self.polls -= 1
        return self.error is not None or self.polls < 0

    def wait(self, timeout=None):
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)
        return True


class _Group:
    def __init__(self, works=(), post_error=None):
        self.works, self.post_error, self.closed = list(works), post_error, False

    def send(self, tensors, peer, tag):
        if self.post_error:
            raise RuntimeError(self.post_error)
        return self.works.pop(0)

    recv = send

    def abort(self):
        self.closed = True


def test_nccl_transfers_are_polled_on_the_host_and_every_error_is_a_plane_error():
    """The NCCL path's logic, emulated: wait() there only orders the stream, so completion is polled on
    the host and bounded by the channel's timeout; errors while posting or completing, as NCCL raises
    them, are PlaneErrors (the client then retries on a new channel) rather than a crash."""

    def channel(group, timeout=0.3):
        return plane.Channel("c", group, "nccl", torch.device("cpu"), timeout)

    done = [_Work(polls=3), _Work(polls=1)]
    channel(_Group(done)).send({"a": torch.ones(2), "b": torch.ones(3)}, tag=1)
    assert all(w.waited for w in done)
    start = time.monotonic()
    with pytest.raises(plane.PlaneError, match="did not finish within 0.3 s"):
        channel(_Group([_Work(polls=10**9)])).send({"a": torch.ones(2)}, tag=1)
    assert time.monotonic() - start < 2
    with pytest.raises(
        plane.PlaneError, match="receiving .* failed: NCCL error: remote process exited"
    ):
        channel(_Group([_Work(error="NCCL error: remote process exited\nmore")])).recv(
            [("a", torch.float32, [2])], tag=1
        )
    with pytest.raises(plane.PlaneError, match="sending .* failed: NCCL communicator was aborted"):
        channel(_Group(post_error="NCCL communicator was aborted on rank 0")).send(
            {"a": torch.ones(2)}, tag=1
        )


def test_nccl_channels_abort_themselves_not_the_process(monkeypatch):
    """An NCCL channel is made with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, keep the
    process): with torch's default (3) a trainer gone mid-transfer would end the server. The process's
    own setting is left as it was."""
    import datetime

    import torch.distributed as dist

    seen = []

    class FakeNCCL:
        class Options:
            pass

        def __init__(self, store, rank, size, options):
            seen.append(
                ({k: os.environ.get(k) for k in plane.NCCL_ENV}, rank, size, options._timeout)
            )

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    for before in (None, "3"):
        for name in plane.NCCL_ENV:
            if before is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, before)
        plane.pair(None, 1, "nccl", "127.0.0.1", datetime.timedelta(seconds=7))
        assert all(os.environ.get(name) == before for name in plane.NCCL_ENV)
    want = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
    }
    assert seen == [(want, 1, 2, datetime.timedelta(seconds=7))] * 2


def test_the_gloo_join_is_bounded_by_the_connect_timeout():
    """A client whose server never makes its end waits --connect-timeout, not the transfer timeout."""
    import datetime
    import socket

    import torch.distributed as dist

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        True,
        datetime.timedelta(seconds=30),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        plane.pair(
            dist.PrefixStore("lonely", store),
            1,
            "gloo",
            "127.0.0.1",
            datetime.timedelta(seconds=600),
            connect=datetime.timedelta(seconds=1),
        )
    assert time.monotonic() - start < 10


def test_idle_channels_are_closed(monkeypatch):
    """A trainer gone without its goodbye leaves channels: those unused for IDLE_SECONDS are closed when
    a channel is opened, and a full server closes its least recently used one idle past its timeout."""
    host = PlaneHost("127.0.0.1", 0, timeout=5)
    monkeypatch.setattr(
        plane.threading, "Thread", lambda **kw: type("T", (), {"start": lambda self: None})()
    )
    now = time.monotonic()

    def add(name, idle):
        group = _Group()
        group.shutdown = lambda: setattr(group, "closed", True)
        channel = plane.Channel(name, group, "gloo", torch.device("cpu"), 5, last_used=now - idle)
        host._channels[name] = ("client", None, [channel])
        return group

    try:
        old, recent = add("old", plane.IDLE_SECONDS + 10), add("recent", 1)
        host.open("c", "gloo", "127.0.0.1")
        assert old.closed and not recent.closed and "old" not in host._channels
        quiet = add("quiet", 60)
        monkeypatch.setattr(plane, "MAX_CHANNELS", len(host._channels))  # full
        answer = host.open("c", "gloo", "127.0.0.1")
        assert answer["channel"] and quiet.closed and not recent.closed
        add("busy", 0)
        assert (
            host.open("c", "gloo", "127.0.0.1")["channel"] is None
        )  # all in use: refused, none closed
        assert not recent.closed
    finally:
        host._channels.clear()
        host.close()


def test_a_plane_beyond_this_machine_is_announced_with_its_exposure(tiny_llama_dir, capsys):
    """Served beyond loopback, the start-up says the rendezvous port takes connections without the token
    (the case the plane exists for is between hosts, so it stays on; the user decides)."""
    from spec_cli.serve.run import _serve_until_stopped

    said = {}
    for host in ("127.0.0.1", "0.0.0.0"):
        handle = start_server(
            load_backend(tiny_llama_dir),
            tiny_llama_dir,
            token="tok",
            host=host,
            plane=PlaneHost(host, 0, timeout=5),
        )
        try:
            capsys.readouterr()
            _serve_until_stopped(
                handle, tiny_llama_dir, "tok", lambda url, h=handle: h.logic.shutdown_event.set()
            )
            out = capsys.readouterr()
            said[host] = " ".join((out.out + out.err).split())
        finally:
            handle.logic.plane.close()
            handle.logic.backend.close()
    port = "takes connections without the token"
    assert port not in said["127.0.0.1"]
    assert port in said["0.0.0.0"] and "--no-tensor-plane" in said["0.0.0.0"]
