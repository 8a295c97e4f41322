"""The client half of `spec serve-target`: `RemoteBackend`, supervision from servers over HTTP.

It implements the same interface as the in-process target, and the server runs the very same
`generate_batch`, so a remote run gets the same tensors bit for bit. Only draft-vocab supervision
crosses the wire (the TargetBatch tensors), never full-vocab logits.

- Several URLs: each batch goes to the server with the fewest requests in flight (round robin on
  ties); a server that cannot be reached is skipped for the retry.
- `generate_batch` may be called from several threads at once (each has its own connections): the
  trainer's producer threads (spec_cli/stream) keep `--prefetch` N requests in flight, so target
  inference overlaps draft training.
- The tensor plane (plane.py): when a server offers one and this process can join it, each thread
  opens its own channel and a generate's tensors come over torch.distributed (NCCL onto this
  process's GPU, gloo otherwise) after a JSON header; HTTP bodies are the fallback, chosen per server
  (`transport` says which, and why). A transfer that fails drops its channel and retries the request.
- Timeouts on every socket operation, bounded retries with exponential backoff on connection errors,
  and a RemoteError (message + hint) when a server is gone, refuses a request, or serves a different
  target than the trainer expects (RemoteMismatchError).
"""

from __future__ import annotations

import datetime
import http.client
import logging
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from spec_cli.batch import EXTRA, TargetBatch
from spec_cli.errors import TargetError
from spec_cli.serve import plane, wire
from spec_cli.serve.server import IMAGES
from spec_cli.serve.wire import TOKEN_ENV
from spec_cli.targets.backend import TargetBackend, require_images

log = logging.getLogger(__name__)

# what identifies a target: compared across servers and with `expect`
IDENTITY_KEYS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "aux_layers",
    "dtype",
    "target_fingerprint",
    "tokenizer_fingerprint",
)
BATCH_FIELDS = (
    "aux_hidden",
    "input_ids",
    "attention_mask",
    "loss_mask",
    "target_p",
    "position_mask",
    "target_ids",
    "target_mass",
)


class RemoteError(TargetError):
    """The remote target server cannot be reached, or refused or failed a request."""


class RemoteMismatchError(RemoteError):
    """The remote server serves a different target (or aux layers, or protocol) than expected."""


class _Server:
    def __init__(self, url: str):
        text = url.strip()
        if "://" not in text:
            text = "http://" + text
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(
                f"--remote {url!r} is not an http(s)://HOST:PORT address",
                "e.g. --remote http://10.0.0.5:8000",
            )
        if parts.path not in ("", "/") or parts.query:
            raise RemoteError(
                f"--remote {url!r} has a path; give only scheme, host and port",
                "e.g. --remote http://10.0.0.5:8000",
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise RemoteError(
                f"--remote {url!r}: {exc}", "e.g. --remote http://10.0.0.5:8000"
            ) from None
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, port
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.in_flight = 0
        self.info: dict = {}
        self.plane_off: str | None = None  # why this server's answers come in HTTP bodies
        self.plane_failures = 0


class _Retry(Exception):
    """A connection-level failure worth another attempt."""


class _Conflict(RemoteError):
    """409 from a server: it lacks our vocab mapping (code "vocab": restarted, or never told)."""

    def __init__(self, message: str, server: _Server, code: str | None):
        super().__init__(message, None)
        self.server, self.code = server, code


class RemoteBackend(TargetBackend):
    """Supervision from one or more `spec serve-target` servers.

    urls: server addresses ("http://host:port"; "host:port" works too).
    token: sent as `Authorization: Bearer`; default $SPEC_SERVE_TOKEN.
    timeout: seconds any one socket operation may wait (a generate's answer included).
    retries, backoff: attempts after a connection error, waiting backoff * 2**k seconds before each.
    expect: identity the trainer requires, e.g. {"target_fingerprint": ..., "tokenizer_fingerprint":
        ..., "aux_layers": [...]} (any key of `info`); a difference raises RemoteMismatchError.
    tensor_plane: join the servers' tensor plane when they offer one (False: HTTP bodies only).
    device: where the trainer wants the supervision; a CUDA device asks for an NCCL channel.
    """

    PLANE_FAILURES = 3  # failed transfers after which a server's answers come in HTTP bodies

    def __init__(
        self,
        urls: list[str] | str,
        token: str | None = None,
        timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 0.5,
        expect: dict | None = None,
        connect_timeout: float = 10.0,
        tensor_plane: bool = True,
        device: torch.device | str | None = None,
    ):
        if isinstance(urls, str):
            urls = urls.split(",")
        urls = [u for u in (u.strip() for u in urls) if u]
        if not urls:
            raise RemoteError(
                "no --remote server address given", "e.g. --remote http://10.0.0.5:8000"
            )
        if retries < 0 or timeout <= 0 or connect_timeout <= 0 or backoff < 0:
            raise RemoteError(
                "retries must be >= 0 and the timeouts > 0", "e.g. retries=3, timeout=600"
            )
        self.servers = [_Server(u) for u in urls]
        if len({s.url for s in self.servers}) != len(self.servers):
            raise RemoteError(
                "the same server is listed twice in --remote", "list each server once"
            )
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.connect_timeout = connect_timeout
        self.client_id = uuid.uuid4().hex
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._turn = 0
        self._closing = self._closed = False
        self._embeddings: torch.Tensor | None = None
        self._vocab: tuple[str, wire.Encoded, int] | None = None  # (vocab_id, message, Vd)
        self.tensor_plane = tensor_plane
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._channels: list[plane.Channel] = []
        self.received = {"plane": 0, "http": 0}  # generate answers by how their tensors came
        try:
            self._connect_all(expect or {})
            self._probe_plane()
        except BaseException:
            self._close_connections()
            raise

    # ------------------------------------------------------------------ connections
    def _connection(self, server: _Server) -> tuple[http.client.HTTPConnection, bool]:
        """(this thread's connection to `server`, whether it is new)."""
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(server.url)
        if conn is not None and conn.sock is not None:
            return conn, False
        cls = (
            http.client.HTTPSConnection if server.scheme == "https" else http.client.HTTPConnection
        )
        conn = cls(server.host, server.port, timeout=self.connect_timeout)
        conn.connect()
        conn.sock.settimeout(self.timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns[server.url] = conn
        with self._lock:
            self._conns.append(conn)
        return conn, True

    def _drop(self, server: _Server) -> None:
        conn = getattr(self._local, "conns", {}).pop(server.url, None)
        if conn is not None:
            conn.close()

    def _exchange(
        self,
        server: _Server,
        method: str,
        path: str,
        body,
        timeout: float,
        headers: dict | None = None,
    ) -> tuple[int, str, bytearray]:
        """One request on this thread's keep-alive connection -> (status, content type, body)."""
        parts, nbytes = (
            (body.parts, body.nbytes) if isinstance(body, wire.Encoded) else ([body], len(body))
        )
        ctype = wire.TENSOR_TYPE if isinstance(body, wire.Encoded) else wire.JSON_TYPE
        for attempt in range(
            2
        ):  # a reused connection the server closed meanwhile: once more, fresh
            try:
                conn, fresh = self._connection(server)
            except OSError as exc:  # refused, unreachable, or no handshake within connect_timeout
                raise _Retry(f"cannot connect: {exc}") from exc
            try:
                conn.sock.settimeout(timeout)
                conn.putrequest(method, path, skip_accept_encoding=True)
                conn.putheader("Content-Type", ctype)
                conn.putheader("Content-Length", str(nbytes))
                conn.putheader("X-Spec-Client", self.client_id)
                if self.token:
                    conn.putheader("Authorization", f"Bearer {self.token}")
                for key, value in (headers or {}).items():
                    conn.putheader(key, value)
                conn.endheaders()
                for part in parts:
                    conn.send(part)
                response = conn.getresponse()
                length = int(response.getheader("Content-Length") or 0)
                data = bytearray(length)
                view, got = memoryview(data), 0
                while got < length:
                    n = response.readinto(view[got:])
                    if not n:
                        raise http.client.IncompleteRead(bytes(view[:0]), length - got)
                    got += n
                if response.will_close:
                    self._drop(server)
                return response.status, response.getheader("Content-Type") or "", data
            except TimeoutError:
                self._drop(server)
                raise
            except (OSError, http.client.HTTPException) as exc:
                self._drop(server)
                stale = not fresh and isinstance(
                    exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
                )
                if stale and attempt == 0:
                    continue
                raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    def _pick(self, avoid: set[str]) -> _Server:
        with self._lock:
            candidates = [s for s in self.servers if s.url not in avoid] or self.servers
            self._turn += 1
            n = len(candidates)
            ordered = [candidates[(self._turn + i) % n] for i in range(n)]
            return min(ordered, key=lambda s: s.in_flight)

    def _call(
        self,
        method: str,
        path: str,
        body=b"",
        server: _Server | None = None,
        what: str = "the request",
        retries: int | None = None,
        timeout: float | None = None,
        plane_ok: bool = False,
    ) -> tuple[_Server, dict | tuple]:
        """Send with retries; (server, JSON object) or (server, (tensors, metadata)).

        `server` pins the request to one server; otherwise a failed attempt moves to another.
        `plane_ok`: the answer's tensors may come over this thread's tensor-plane channel."""
        retries = self.retries if retries is None else retries
        avoid: set[str] = set()
        last, srv = "", server
        for attempt in range(retries + 1):
            if self._closed:
                raise RemoteError("the remote backend is closed", "this is a bug in the caller")
            srv = server or self._pick(avoid)
            channel = self._channel(srv) if plane_ok else None
            with self._lock:
                srv.in_flight += 1
            try:
                status, ctype, data = self._exchange(
                    srv,
                    method,
                    path,
                    body,
                    timeout or self.timeout,
                    {"X-Spec-Plane": channel.name} if channel else None,
                )
                if status == 200 and channel is not None and ctype.startswith(wire.JSON_TYPE):
                    return srv, self._receive(srv, channel, data, what)
            except TimeoutError:
                raise RemoteError(
                    f"the target server {srv.url} gave no answer to {what} within "
                    f"{timeout or self.timeout:g} s",
                    "check the server's log (a batch too large for it?) or raise the "
                    "client timeout",
                ) from None
            except (
                plane.PlaneError
            ) as exc:  # the channel is dead: retry on a new one (or over HTTP)
                self._plane_failed(srv, exc)
                last, status = f"tensor plane: {exc}", None
            except (_Retry, OSError) as exc:
                last = str(exc)
                status = None
                if channel is not None:  # the server may send this answer's tensors into it still
                    self._drop_channel(srv)
            finally:
                with self._lock:
                    srv.in_flight -= 1
            if status is not None and status != 503:
                return srv, self._answer(srv, status, ctype, data, what)
            if status == 503:
                last = "the server is shutting down"
            avoid.add(srv.url)
            if attempt < retries:
                log.warning("%s: %s (attempt %d of %d)", srv.url, last, attempt + 1, retries + 1)
                time.sleep(self.backoff * 2**attempt)
        where = (
            srv.url if len(self.servers) == 1 or server else ", ".join(s.url for s in self.servers)
        )
        raise RemoteError(
            f"the target server {where} cannot be reached ({last}) after {retries + 1} attempt(s)",
            "check that `spec serve-target` still runs there; the training run can "
            "continue from its last checkpoint with --resume",
        )

    def _answer(self, server: _Server, status: int, ctype: str, data: bytearray, what: str):
        if status == 200:
            try:
                return wire.decode(data) if ctype.startswith(wire.TENSOR_TYPE) else wire.loads(data)
            except wire.WireError as exc:
                raise RemoteError(
                    f"the target server {server.url} sent a malformed answer to {what}: {exc}",
                    "check that server and trainer run the same spec_cli",
                ) from None
        try:
            error = wire.loads(data)
            message, code, hint = str(error.get("error", "")), error.get("code"), error.get("hint")
        except wire.WireError:
            message, code, hint = bytes(data[:200]).decode("utf-8", "replace"), None, None
        if status == 401:
            raise RemoteError(
                f"the target server {server.url} refused the token",
                f"pass the server's token (--token or ${TOKEN_ENV})",
            )
        if status == 409:
            raise _Conflict(message, server, code)
        hint = (
            str(hint)
            if status == 422 and hint
            # the target refuses it, and says what to do
            else "lower --batch-tokens / --max-length, or raise the server's --max-batch-tokens / "
            "--max-seq-len / --max-body-bytes"
            if status == 413 or "limit" in message
            else "see the server's log"
            if status >= 500
            else "check that server and trainer run the same spec_cli version"
        )
        raise RemoteError(
            f"the target server {server.url} answered {status} to {what}: {message}", hint
        )

    # ------------------------------------------------------------------ tensor plane
    def _plane_backend(self, server: _Server) -> str:
        """NCCL when the trainer's device is a GPU and both ends run NCCL (the tensors then go GPU to
        GPU), else gloo (host memory)."""
        offer = server.info.get("plane") or {}
        both = "nccl" in (offer.get("backends") or []) and "nccl" in plane.backends()
        if not (self.device.type == "cuda" and both):
            return "gloo"
        # trainer and server on one GPU: NCCL cannot pair a device with itself
        same = offer.get("gpu") is not None and offer.get("gpu") == plane.gpu_identity(self.device)
        return "gloo" if same else "nccl"

    def _probe_plane(self) -> None:
        """Open this thread's channel to each server now, so `transport` says how answers will come."""
        for server in self.servers:
            self._channel(server)

    def _channel(self, server: _Server) -> plane.Channel | None:
        """This thread's channel to `server` (opened on first use), or None: HTTP bodies."""
        if not self.tensor_plane:
            server.plane_off = server.plane_off or "--no-tensor-plane"
        offer = server.info.get("plane")
        if server.plane_off is None and not (isinstance(offer, dict) and offer.get("backends")):
            server.plane_off = "the server offers no tensor plane"
        if server.plane_off is not None:
            return None
        channels = getattr(self._local, "channels", None)
        if channels is None:
            channels = self._local.channels = {}
        if server.url in channels:
            return channels[server.url]
        backend = self._plane_backend(server)
        try:
            _, answer = self._call(
                "POST",
                "/v1/plane",
                wire.dumps({"backend": backend}),
                server=server,
                retries=0,
                what="the tensor-plane request",
            )
            name, port = answer.get("channel"), answer.get("port")
            if not isinstance(name, str) or not isinstance(port, int):
                raise plane.PlaneError(str(answer.get("reason") or "the server opened no channel"))
            conn = getattr(self._local, "conns", {}).get(server.url)
            address = (
                conn.sock.getsockname()[0]
                if conn is not None and conn.sock is not None
                else "127.0.0.1"
            )  # this process as the server reaches it: the HTTP connection's own end
            wait = datetime.timedelta(seconds=self.connect_timeout)
            store = dist.TCPStore(server.host, port, None, False, wait)
            group = plane.pair(
                dist.PrefixStore(plane.PREFIX + name, store),
                1,
                backend,
                address,
                datetime.timedelta(seconds=self.timeout),
                connect=wait,
            )
        except (
            RemoteError
        ):  # the server is unreachable: this attempt goes over HTTP (and fails there)
            return None
        except (plane.PlaneError, RuntimeError, OSError, ValueError) as exc:
            server.plane_off = f"could not join its tensor plane: {str(exc).splitlines()[0][:200]}"
            log.warning("%s: %s; its answers come in HTTP bodies", server.url, server.plane_off)
            return None
        channel = plane.Channel(
            name,
            group,
            backend,
            self.device if backend == "nccl" else torch.device("cpu"),
            self.timeout,
        )
        channels[server.url] = channel
        with self._lock:
            self._channels.append(channel)
        return channel

    def _drop_channel(self, server: _Server) -> None:
        channel = getattr(self._local, "channels", {}).pop(server.url, None)
        if channel is not None:
            channel.close()

    def _plane_failed(self, server: _Server, exc: Exception) -> None:
        self._drop_channel(server)
        with self._lock:
            server.plane_failures += 1
            if server.plane_failures >= self.PLANE_FAILURES and server.plane_off is None:
                server.plane_off = f"{server.plane_failures} transfers over its tensor plane failed"
                log.warning(
                    "%s: %s (last: %s); its answers come in HTTP bodies",
                    server.url,
                    server.plane_off,
                    exc,
                )

    def _receive(
        self, server: _Server, channel: plane.Channel, data: bytearray, what: str
    ) -> tuple:
        """The tensors a plane answer announces, received over `channel`: (tensors, metadata, "plane")."""
        try:
            header = wire.loads(data)
            specs = plane.parse_header(header.get("tensors"))
            tag = header.get("tag")
            if (
                header.get("plane") != channel.name
                or not isinstance(tag, int)
                or isinstance(tag, bool)
            ):
                raise wire.WireError("the answer names another channel or no tag")
        except wire.WireError as exc:
            self._drop_channel(server)  # whatever the server sends now would be unmatched
            raise RemoteError(
                f"the target server {server.url} sent a malformed tensor-plane answer to "
                f"{what}: {exc}",
                "check that server and trainer run the same spec_cli",
            ) from None
        tensors = channel.recv(specs, tag)
        server.plane_failures = 0  # failures in a row turn the plane off: one transfer worked
        return tensors, {"vocab_id": header.get("vocab_id")}, "plane"

    @property
    def lands_on(self) -> torch.device:
        """Where received batches are: this process's GPU when a server's channel is NCCL, else the host."""
        nccl = any(s.plane_off is None and self._plane_backend(s) == "nccl" for s in self.servers)
        return self.device if nccl else torch.device("cpu")

    @property
    def transport(self) -> str:
        """How the servers' answers travel, in words (the training log prints it)."""
        parts = []
        for server in self.servers:
            if server.plane_off is None:
                parts.append(
                    f"{server.url}: tensor plane ({self._plane_backend(server)}, after a JSON header)"
                )
            else:
                parts.append(f"{server.url}: HTTP bodies ({server.plane_off})")
        return "; ".join(parts)

    # ------------------------------------------------------------------ identity
    def _connect_all(self, expect: dict) -> None:
        for server in self.servers:
            _, server.info = self._call("GET", "/v1/info", server=server, what="the info request")
            if server.info.get("protocol") != wire.PROTOCOL:
                raise RemoteMismatchError(
                    f"the target server {server.url} speaks protocol {server.info.get('protocol')}, "
                    f"this trainer {wire.PROTOCOL}",
                    "run the same spec_cli version on both machines",
                )
        first = self.servers[0]
        for server in self.servers[1:]:
            for key in IDENTITY_KEYS:
                if server.info.get(key) != first.info.get(key):
                    raise RemoteMismatchError(
                        f"the target servers disagree on {key.replace('_', ' ')}: {first.url} has "
                        f"{first.info.get(key)!r}, {server.url} has {server.info.get(key)!r}",
                        "start every server with the same target, --aux-layers and --dtype",
                    )
        for key, want in expect.items():
            if want is None:
                continue
            got = first.info.get(key)
            if got != want:
                raise RemoteMismatchError(
                    f"the target server {first.url} serves a different {key.replace('_', ' ')}: "
                    f"{got!r}, the run expects {want!r}",
                    "start `spec serve-target` with the target and --aux-layers this run (or its "
                    "vocab map / cache) was made with, or point --remote at the right server",
                )
        self.info = {k: first.info.get(k) for k in IDENTITY_KEYS}
        self.reads_images = all(
            s.info.get("reads_images") for s in self.servers
        )  # their targets run images
        self.target_config: dict | None = first.info.get("target_config")
        self.limits = {
            k: min(s.info["limits"][k] for s in self.servers) for k in first.info["limits"]
        }

    def load_tokenizer(self, folder: Path | None = None):
        """The server's tokenizer (saved under SPEC_HOME), checked against its fingerprint."""
        from spec_cli.artifacts.io import atomic_dir
        from spec_cli.paths import spec_home
        from spec_cli.targets import loading

        fingerprint = self.info["tokenizer_fingerprint"]
        folder = Path(folder) if folder else spec_home() / "remote" / "tokenizers" / fingerprint
        if not folder.is_dir():
            server, answer = self._call("GET", "/v1/tokenizer", what="the tokenizer request")
            files = answer.get("files")
            if not isinstance(files, dict) or not files:
                raise RemoteError(
                    f"the target server {server.url} sent no tokenizer files",
                    "check that server and trainer run the same spec_cli version",
                )
            for name, text in files.items():
                if not (
                    isinstance(name, str)
                    and isinstance(text, str)
                    and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", name)
                ):
                    raise RemoteError(
                        f"the target server {server.url} sent a tokenizer file with a "
                        f"bad name {str(name)[:60]!r}",
                        "check the server",
                    )
            try:
                with atomic_dir(folder) as tmp:
                    for name, text in files.items():
                        (tmp / name).write_text(text, encoding="utf-8")
            except OSError:
                if not folder.is_dir():  # else another process (rank) saved it meanwhile
                    raise
        self.tokenizer_folder = (
            folder  # (with a vision-language target's processor files: load_processor)
        )
        tokenizer = loading.load_tokenizer(folder)
        if loading.tokenizer_fingerprint(tokenizer) != fingerprint:
            raise RemoteMismatchError(
                "the tokenizer the server sent does not reproduce its fingerprint",
                f"delete {folder} and retry; else run the same transformers "
                "version on both machines",
            )
        return tokenizer

    # ------------------------------------------------------------------ interface
    def get_input_embeddings(self) -> torch.Tensor:
        if self._embeddings is None:
            _, (tensors, _) = self._call("GET", "/v1/input_embeddings", what="the input embeddings")
            weight = tensors.get("weight")
            V, H = self.info["vocab_size"], self.info["hidden_size"]
            if weight is None or weight.dim() != 2 or weight.shape[1] != H or weight.shape[0] < 1:
                raise RemoteError(
                    "the target server sent input embeddings of the wrong shape",
                    f"expected [~{V}, {H}]; check the server",
                )
            self._embeddings = weight
        return self._embeddings

    def get_output_head(self) -> dict[str, torch.Tensor] | None:
        if self._vocab is None:
            return None
        vid, _, Vd = self._vocab
        server = self.servers[0]
        try:
            _, (tensors, _) = self._call(
                "POST",
                "/v1/output_head",
                wire.dumps({"vocab_id": vid}),
                server=server,
                what="the output head",
            )
        except _Conflict:  # the server restarted and lost our mapping: send it again, once
            self._send_vocab(server)
            _, (tensors, _) = self._call(
                "POST",
                "/v1/output_head",
                wire.dumps({"vocab_id": vid}),
                server=server,
                what="the output head",
            )
        H = self.info["hidden_size"]
        head = tensors.get("lm_head_selected")
        if head is None or tuple(head.shape) != (Vd, H):
            raise RemoteError(
                "the target server sent an output head of the wrong shape",
                f"expected [{Vd}, {H}]; check that server and trainer run the same spec_cli",
            )
        return tensors

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        ids = selected_token_ids.detach().to("cpu", torch.int64).contiguous()
        vid = wire.vocab_id(ids)
        self._vocab = (vid, wire.encode({"selected_token_ids": ids}), int(ids.numel()))
        for server in self.servers:
            self._send_vocab(server)

    def _send_vocab(self, server: _Server) -> None:
        vid, message, _ = self._vocab
        try:
            _, answer = self._call(
                "POST", "/v1/vocab_mapping", message, server=server, what="the vocab mapping"
            )
        except _Conflict as exc:
            raise RemoteError(
                f"the target server {server.url} refused the vocab mapping: {exc}",
                "check the server",
            ) from None
        if answer.get("vocab_id") != vid:
            raise RemoteError(
                f"the target server {server.url} stored a different vocab mapping",
                "check that server and trainer run the same spec_cli version",
            )

    def _request(
        self, input_ids, attention_mask, loss_mask, position_ids, seq_lens, images=None
    ) -> wire.Encoded:
        if self._vocab is None:
            raise RuntimeError("set_vocab_mapping() must be called before generate_batch()")
        tensors = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "seq_lens": seq_lens,
        }
        tensors = {
            k: v.detach().to("cpu", torch.int64) for k, v in tensors.items() if v is not None
        }  # int64 on the wire
        for name, value in (
            images or {}
        ).items():  # image-text rows: pixel values as fp32, the rest int64
            tensors[IMAGES + name] = value.detach().to(
                "cpu", torch.float32 if value.is_floating_point() else torch.int64
            )
        message = wire.encode(
            tensors,
            {
                "vocab_id": self._vocab[0],
                "final_hidden": self.keep_final_hidden,
                **({"extras": sorted(self.extra_fields)} if self.extra_fields else {}),
            },
        )
        B, T = input_ids.shape if input_ids.dim() == 2 else (1, input_ids.numel())
        limits = self.limits
        for what, value, limit, option in (
            ("sequence length", T, limits["max_seq_len"], "--max-seq-len"),
            ("batch size", B, limits["max_batch_size"], "--max-batch-size"),
            ("batch tokens (B x T)", B * T, limits["max_batch_tokens"], "--max-batch-tokens"),
            ("request bytes", message.nbytes, limits["max_body_bytes"], "--max-body-bytes"),
        ):
            if value > limit:  # refused before it is sent
                raise RemoteError(
                    f"a batch's {what} {value} exceeds the target server's limit {limit}",
                    f"lower --batch-tokens / --max-length, or start the server with a "
                    f"larger {option}",
                )
        return message

    def _generate(self, message: wire.Encoded, shape: tuple[int, int]) -> TargetBatch:
        resent: set[str] = set()
        reopened: set[str] = set()
        # each server may need our vocab mapping once more and a new channel (a restarted server needs
        # both: neither uses up the other's tries), and its plane may fail until it is turned off
        for _ in range(len(self.servers) * (2 + self.PLANE_FAILURES) + 1):
            try:
                server, answer = self._call(
                    "POST", "/v1/generate", message, what="a generate request", plane_ok=True
                )
            except _Conflict as exc:
                server = exc.server
                if (
                    exc.code == "plane"
                ):  # the server lost this thread's channel (restarted, or closed an
                    if (
                        server.url in reopened
                    ):  # idle one): a new one; a failure only when it repeats
                        self._plane_failed(server, exc)
                    else:
                        reopened.add(server.url)
                        self._drop_channel(server)
                    continue
                if exc.code != "vocab" or server.url in resent:
                    raise RemoteError(
                        f"the target server {server.url} refused a generate request: {exc}",
                        "check the server's log",
                    ) from None
                resent.add(server.url)  # the server lost (or never had) our vocab mapping: resend
                self._send_vocab(server)
                continue
            if not isinstance(answer, tuple):
                raise RemoteError(
                    f"the target server {server.url} answered without tensors",
                    "check that server and trainer run the same spec_cli version",
                )
            batch = self._batch(server, answer[0], shape)
            with self._lock:
                self.received["plane" if len(answer) == 3 else "http"] += 1
            return batch
        raise RemoteError("the target servers keep refusing generate requests", "check the servers")

    def _batch(self, server: _Server, tensors: dict[str, torch.Tensor], shape) -> TargetBatch:
        B, T = shape
        Vd, Ha = self._vocab[2], len(self.info["aux_layers"]) * self.info["hidden_size"]
        H = self.info["hidden_size"]
        extras = {EXTRA + name: [B, T, f.width(H)] for name, f in self.extra_fields.items()}
        fields = (
            BATCH_FIELDS + (("final_hidden",) if self.keep_final_hidden else ()) + tuple(extras)
        )
        expected = (
            {name: [B, T] for name in BATCH_FIELDS}
            | {"aux_hidden": [B, T, Ha], "target_p": [B, T, Vd], "final_hidden": [B, T, H]}
            | extras
        )
        problems = [n for n in fields if n not in tensors or list(tensors[n].shape) != expected[n]]
        if problems or set(tensors) - set(fields) - {"position_ids", "seq_lens"}:
            raise RemoteError(
                f"the target server {server.url} sent a malformed batch "
                f"(fields {sorted(tensors)}; wrong: {problems})",
                "check that server and trainer run the same spec_cli version",
            )
        return TargetBatch.from_tensors(tensors)

    def generate_batch(
        self,
        input_ids,
        attention_mask,
        loss_mask,
        position_ids=None,
        seq_lens=None,
        images: dict | None = None,
    ) -> TargetBatch:
        """`images`: an image-text batch's image inputs (data/vlm.py), sent along; the server's target
        runs its vision part on them (`reads_images`: every server says it does)."""
        if images is not None:
            require_images(self)
        message = self._request(
            input_ids, attention_mask, loss_mask, position_ids, seq_lens, images
        )
        return self._generate(message, tuple(input_ids.shape))

    def close(self) -> None:
        """Say goodbye to each server (best effort, 5 s), close connections."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for server in self.servers:
            try:
                self._call(
                    "POST",
                    "/v1/disconnect",
                    b"{}",
                    server=server,
                    retries=0,
                    what="the disconnect",
                    timeout=min(5.0, self.timeout),
                )
            except (RemoteError, OSError):
                pass
        self._closed = True
        self._close_connections()

    def _close_connections(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass
