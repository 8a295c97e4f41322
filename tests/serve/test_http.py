"""The HTTP server under abuse: malformed requests get a 4xx and it keeps serving; clean shutdown.

Every socket has a timeout and every loop a fixed count; only 127.0.0.1 is used.
"""

import json
import random
import signal
import socket
import threading
import time

import pytest
import torch

from spec_cli.serve import wire
from spec_cli.serve.client import RemoteBackend, RemoteError
from spec_cli.serve.server import Limits
from spec_cli.serve.wire import vocab_id
from tests.serve.harness import ServerProcess, draft_vocab, load_backend, random_batch, start_server
from tests.serve.test_server import BAD_GENERATE

TOKEN = "tok-" + "x" * 28


@pytest.fixture(scope="module")
def backends(tiny_llama_dir):
    served, local = load_backend(tiny_llama_dir), load_backend(tiny_llama_dir)
    local.set_vocab_mapping(draft_vocab())
    yield served, local
    served.close()
    local.close()


@pytest.fixture(scope="module")
def server(backends, tiny_llama_dir):
    handle = start_server(
        backends[0],
        tiny_llama_dir,
        token=TOKEN,
        request_timeout=1.0,
        limits=Limits(
            max_batch_tokens=1024, max_batch_size=8, max_seq_len=256, max_body_bytes=1 << 20
        ),
    )  # as in test_server (BAD_GENERATE)
    yield handle
    handle.stop(grace=5)


def exchange(port: int, data: bytes, timeout: float = 5.0) -> int:
    """Send raw bytes, close our side, read the answer; its HTTP status (0 if none)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        received = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(received) < 1 << 20:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            received += chunk
    head = received.split(b"\r\n", 1)[0].split()
    status = int(head[1]) if len(head) >= 2 and head[1].isdigit() else 0
    if status >= 400:  # every error answer is JSON saying what is wrong
        body = received.split(b"\r\n\r\n", 1)[1]
        assert json.loads(body)["error"], received[:300]
    return status


def request(
    path: str,
    body: bytes = b"",
    method: str = "POST",
    token: str | None = TOKEN,
    length: int | None = None,
    extra: str = "",
) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    if length is not None or body:
        head += f"Content-Length: {len(body) if length is None else length}\r\n"
    return (head + extra + "\r\n").encode() + body


def good_message(seed: int = 0) -> bytes:
    ids, am, lm = random_batch(seed=seed)
    return wire.encode(
        {"input_ids": ids, "attention_mask": am, "loss_mask": lm},
        {"vocab_id": vocab_id(draft_vocab())},
    ).tobytes()


def malformed_requests(rng: random.Random) -> list[tuple[str, bytes]]:
    good = good_message()
    head_len = 8 + int.from_bytes(good[:8], "little")
    text_positions = [i for i in range(8, head_len) if good[i : i + 1] not in b" "]
    cases = []
    for path, method in [
        ("/v1/health", "GET"),
        ("/v1/info", "GET"),
        ("/v1/generate", "POST"),
        ("/v1/input_embeddings", "GET"),
        ("/v1/vocab_mapping", "POST"),
        ("/v1/disconnect", "POST"),
        ("/v1/tokenizer", "GET"),
    ]:
        for token in (None, "wrong", TOKEN[:-1], TOKEN + "x", ""):
            cases.append(("token", request(path, good if method == "POST" else b"", method, token)))
    for _ in range(50):  # garbage instead of HTTP
        cases.append(
            ("garbage", bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))) + b"\r\n\r\n")
        )
    cases += [
        ("bad line", b"GET\r\n\r\n"),
        ("bad line", b"GET / HTTP/9.9\r\n\r\n"),
        ("long url", f"GET /{'a' * 70000} HTTP/1.1\r\n\r\n".encode()),
        ("many headers", request("/v1/info", method="GET", extra="X-A: b\r\n" * 120)),
        ("long header", request("/v1/info", method="GET", extra=f"X-A: {'b' * 70000}\r\n")),
        (
            "long client id",
            request("/v1/info", method="GET", extra=f"X-Spec-Client: {'c' * 65}\r\n"),
        ),
    ]
    for method in ("PUT", "DELETE", "HEAD", "FOO", "PATCH"):
        cases.append(("method", request("/v1/generate", good, method)))
    for path in ("/", "/v1", "/v1/generatex", "/v2/generate", "/../etc/passwd", "/v1/health/.."):
        cases.append(("path", request(path, b"", "GET")))
    cases += [
        ("no length", request("/v1/generate", method="POST")),
        ("bad length", request("/v1/generate", b"", length=None, extra="Content-Length: ten\r\n")),
        ("negative length", request("/v1/generate", b"", length=-5)),
        ("huge length", request("/v1/generate", b"x" * 100, length=10**15)),
        ("over limit", request("/v1/generate", b"x" * ((1 << 20) + 1))),
        (
            "chunked",
            request(
                "/v1/generate", b"5\r\nhello\r\n0\r\n\r\n", extra="Transfer-Encoding: chunked\r\n"
            ),
        ),
    ]
    for _ in range(60):  # the body stops early (the declared length is the full one)
        cut = rng.randrange(0, len(good) - 1)
        cases.append(("truncated body", request("/v1/generate", good[:cut], length=len(good))))
    for _ in range(40):  # a complete body that is a truncated message
        cut = rng.randrange(1, len(good) - 1)
        cases.append(("truncated message", request("/v1/generate", good[:cut])))
    for _ in range(60):  # one flipped byte in the safetensors header
        pos = rng.choice(text_positions)
        body = bytearray(good)
        body[pos] ^= rng.choice([0x01, 0x02, 0x10, 0x40, 0x7F])
        cases.append(("flipped header byte", request("/v1/generate", bytes(body))))
    for tensors, _why in BAD_GENERATE:  # well-formed messages, wrong contents
        cases.append(
            (
                "bad tensors",
                request(
                    "/v1/generate",
                    wire.encode(tensors, {"vocab_id": vocab_id(draft_vocab())}).tobytes(),
                ),
            )
        )
    zeros = torch.zeros(16, 257, dtype=torch.long)
    cases.append(
        (
            "too long",
            request(
                "/v1/generate",
                wire.encode(
                    {"input_ids": zeros, "attention_mask": zeros, "loss_mask": zeros}
                ).tobytes(),
            ),
        )
    )
    for text in (b"{", b"[]", b"nul", b"\xff\xfe", b'{"vocab_id": 3}'):
        cases.append(("bad json", request("/v1/output_head", text)))
        cases.append(("json as tensors", request("/v1/vocab_mapping", text)))
    unknown_vocab = wire.encode(
        dict(zip(("input_ids", "attention_mask", "loss_mask"), random_batch())),
        {"vocab_id": "f" * 16},
    )
    cases.append(("unknown vocab", request("/v1/generate", unknown_vocab.tobytes())))
    return cases


def test_hundreds_of_malformed_requests_then_a_good_one(server, backends, tiny_llama_dir):
    remote = RemoteBackend([server.url], token=TOKEN, retries=0, timeout=20)
    remote.set_vocab_mapping(draft_vocab())  # the server knows our vocab before the abuse
    cases = malformed_requests(random.Random(0))
    assert len(cases) >= 300
    start = time.monotonic()
    for kind, data in cases:
        status = exchange(server.port, data)
        assert 400 <= status < 500, (kind, status, data[:120])
    assert time.monotonic() - start < 60
    ids, am, lm = random_batch(seed=1)
    batch = remote.generate_batch(ids, am, lm)  # still serving, and correctly
    expected = backends[1].generate_batch(ids, am, lm)
    for name, t in expected.tensors().items():
        assert torch.equal(getattr(batch, name), t), name
    remote.close()


def test_a_stalled_client_is_cut_off_and_others_are_served(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stalled:
        stalled.sendall(b"POST /v1/generate HTTP/1.1\r\nContent-Le")  # ... and nothing more
        assert exchange(server.port, request("/v1/health", method="GET")) == 200
        start = time.monotonic()
        leftover = stalled.recv(1024)  # the server gives up after its request timeout (1 s)
        assert time.monotonic() - start < 5
        assert leftover == b"" or leftover.startswith(b"HTTP/1.1 4"), leftover


def test_serve_runs_until_the_last_client_disconnects(tiny_llama_dir):
    """serve() itself (as the CLI calls it), in a thread, with exit_on_disconnect."""
    from spec_cli.serve.run import serve

    ready = []
    thread = threading.Thread(
        target=serve,
        args=(tiny_llama_dir,),
        kwargs=dict(
            port=0, device="cpu", dtype="fp32", exit_on_disconnect=True, on_ready=ready.append
        ),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 60
    while not ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready, "serve() never became ready"
    remote = RemoteBackend(ready[0], retries=0)
    remote.set_vocab_mapping(draft_vocab())
    assert remote.generate_batch(*random_batch()).target_p.shape == (3, 20, 64)
    remote.close()
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.slow
def test_sigterm_stops_the_server_cleanly(tiny_llama_dir):
    proc = ServerProcess(tiny_llama_dir, token=TOKEN)
    try:
        remote = RemoteBackend(proc.url, token=TOKEN, retries=1, backoff=0.1, timeout=20)
        remote.set_vocab_mapping(draft_vocab())
        assert remote.generate_batch(*random_batch()).target_p.shape == (3, 20, 64)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=30) == 0
        proc.wait_for("stopped", 5)
        start = time.monotonic()
        with pytest.raises(RemoteError, match="cannot be reached") as err:
            remote.generate_batch(*random_batch())
        assert "spec serve-target" in err.value.hint and time.monotonic() - start < 10
        remote.close()
    finally:
        proc.kill()


def test_a_client_that_resets_its_connection_is_one_log_line_not_a_traceback(server, capfd, caplog):
    """A trainer killed mid-request resets its connections (RST): each is an ordinary event, logged in one
    line; the server goes on answering."""
    import logging
    import struct

    caplog.set_level(logging.INFO, logger="spec_cli.serve.http")
    for partial in (
        b'POST /v1/generate HTTP/1.1\r\nContent-Length: 100000\r\n\r\n{"x": ',
        b"POST /v1/generate HTTP/1.1\r\nContent-Le",
    ):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(partial)
        time.sleep(0.2)  # the server is reading the request
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        s.close()
    time.sleep(0.5)
    assert exchange(server.port, request("/v1/health", method="GET")) == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
    assert any("reset" in r.getMessage() or "ended" in r.getMessage() for r in caplog.records), (
        caplog.text
    )
