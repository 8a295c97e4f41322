"""Optional tensor data plane: supervision tensors over torch.distributed instead of the HTTP body.

`POST /v1/data_plane {"backend": "gloo"}` makes a two-rank process group for one client and one
server (server rank 0, client rank 1). Its rendezvous runs through the token-checked HTTP endpoint
`/v1/data_plane/store`, so no extra rendezvous port is opened (torch's TCPStore would listen on every
interface). A generate request with the header `X-Spec-Data-Plane: SESSION` is answered with JSON
(sequence number, byte count, tensor layout) and, once that answer is flushed, the tensors follow as
one byte buffer over the process group. Both sides send and receive strictly in sequence order, so
concurrent requests cannot cross; any failure or timeout breaks the session and the client goes
back to the HTTP body for good.

Only gloo (CPU tensors) is implemented. The process-group connections themselves are not
authenticated: use the data plane on a trusted network.
"""

from __future__ import annotations

import base64
import datetime
import logging
import secrets
import threading

import torch

from spec_cli.serve import wire
from spec_cli.serve.server import RequestError, Response

log = logging.getLogger(__name__)

MAX_SESSIONS = 64
MAX_KEY = 512
MAX_VALUE = 64 << 10
STORE_WAIT_S = 10.0


def available_backends() -> list[str]:
    import torch.distributed as dist

    return ["gloo"] if dist.is_available() and dist.is_gloo_available() else []


def _gloo_group(store, rank: int, hostname: str, timeout: float):
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = datetime.timedelta(seconds=timeout)
    return dist.ProcessGroupGloo(store, rank, 2, options)


class _Ordered:
    """Runs transfers strictly in sequence order (seq 0, 1, 2, ...); any failure breaks it for good."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.next = 0
        self.broken: str | None = None
        self.cond = threading.Condition()

    def run(self, seq: int, transfer) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.next == seq or self.broken, self.timeout):
                self.breaks(f"transfer {seq} waited {self.timeout:g} s for its turn")
            if self.broken:
                raise RuntimeError(self.broken)
        try:
            transfer()
        except Exception as exc:
            self.breaks(f"transfer {seq} failed: {exc}")
            raise
        with self.cond:
            self.next = seq + 1
            self.cond.notify_all()

    def breaks(self, why: str) -> None:
        with self.cond:
            self.broken = self.broken or why
            self.cond.notify_all()


def pack(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """(one uint8 buffer, layout [[name, dtype code, shape, offset]]), widest dtype first."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    layout, pieces, offset = [], [], 0
    for name in order:
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        pieces.append(t.view(torch.uint8))
        layout.append([name, wire.CODES[t.dtype], list(tensors[name].shape), offset])
        offset += t.numel() * t.element_size()
    buffer = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return buffer, layout


def unpack(buffer: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    out = {}
    for name, code, shape, offset in layout:
        dtype = wire.DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if offset < 0 or offset + nbytes > buffer.numel():
            raise ValueError(f"tensor {name!r} lies outside the received buffer")
        out[name] = buffer[offset:offset + nbytes].view(dtype).view(shape)
    return out


# ----------------------------------------------------------------------------- server side

class _ServerSession:
    def __init__(self, sid: str, client: str, store, hostname: str, timeout: float):
        self.sid, self.client, self.store = sid, client, store
        self.group = None
        self.ready = threading.Event()
        self.order = _Ordered(timeout)
        self._seq = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._connect, args=(store, hostname, timeout), daemon=True,
                         name=f"spec-data-plane-{sid}").start()

    def _connect(self, store, hostname: str, timeout: float) -> None:
        try:
            self.group = _gloo_group(store, 0, hostname, timeout)
        except Exception as exc:  # the client never joined, or the network refused
            self.order.breaks(f"the process group did not form: {exc}")
        finally:
            self.ready.set()

    def take_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq - 1

    def send(self, seq: int, buffer: torch.Tensor) -> None:
        try:
            self.order.run(seq, lambda: self.group.send([buffer], 1, seq).wait())
        except RuntimeError as exc:
            log.warning("data plane %s: %s", self.sid, exc)


class ServerDataPlanes:
    """The data-plane sessions of one TargetServer."""

    def __init__(self, logic, timeout: float = 60.0):
        import torch.distributed as dist

        self.logic = logic
        self.timeout = timeout
        self.kv = dist.HashStore()  # the rendezvous keys of every session
        self.sessions: dict[str, _ServerSession] = {}
        self._lock = threading.Lock()

    def backends(self) -> list[str]:
        return available_backends()

    def _session(self, sid, client) -> _ServerSession:
        with self._lock:
            session = self.sessions.get(sid) if isinstance(sid, str) else None
        if session is None or session.client != client:
            raise RequestError(409, f"no data-plane session {str(sid)[:40]!r} for this client",
                               code="data_plane")
        return session

    def init(self, request: dict, client: str | None, peer: dict) -> dict:
        import torch.distributed as dist

        backend = request.get("backend")
        if backend not in self.backends():
            raise RequestError(400, f"data-plane backend {backend!r} is not offered; this server "
                                    f"offers {self.backends()}")
        if not client:
            raise RequestError(400, "a data-plane session needs the X-Spec-Client header")
        with self._lock:
            if len(self.sessions) >= MAX_SESSIONS:
                raise RequestError(429, f"{MAX_SESSIONS} data-plane sessions are open; use the HTTP body")
            sid = secrets.token_hex(8)
            store = dist.PrefixStore(f"dp/{sid}/", self.kv)
            hostname = peer.get("local_address") or "127.0.0.1"  # where this client reached us
            self.sessions[sid] = _ServerSession(sid, client, store, hostname, self.timeout)
        return {"session": sid, "backend": backend, "rank": 1, "world_size": 2,
                "timeout_s": self.timeout}

    def store(self, request: dict, client: str | None) -> dict:
        session = self._session(request.get("session"), client)
        store = session.store  # this session's keys only
        key, op = request.get("key"), request.get("op")
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
            raise RequestError(400, f"store key must be a string of 1..{MAX_KEY} characters")
        if op == "set":
            value = request.get("value")
            if not isinstance(value, str) or len(value) > 2 * MAX_VALUE:
                raise RequestError(400, "store value must be base64 text of at most 64 KiB")
            try:
                store.set(key, base64.b64decode(value, validate=True))
            except ValueError:
                raise RequestError(400, "store value is not base64") from None
            return {}
        if op in ("get", "wait"):
            try:
                store.wait([key], datetime.timedelta(seconds=STORE_WAIT_S))
            except RuntimeError:
                raise RequestError(408, f"store key not set within {STORE_WAIT_S:g} s") from None
            return {"value": base64.b64encode(store.get(key)).decode()} if op == "get" else {}
        if op == "check":
            return {"ok": bool(store.check([key]))}
        if op == "add":
            amount = request.get("amount")
            if not isinstance(amount, int) or isinstance(amount, bool):
                raise RequestError(400, "store add needs an integer amount")
            return {"value": int(store.add(key, amount))}
        raise RequestError(400, f"unknown store op {op!r}; use set, get, wait, check or add")

    def generate(self, sid, tensors, vid, client) -> Response:
        session = self._session(sid, client)
        if not session.ready.wait(self.timeout) or session.order.broken:
            self.drop(session.sid)
            raise RequestError(409, f"data-plane session {session.sid} is broken "
                                    f"({session.order.broken or 'never formed'}); use the HTTP body",
                               code="data_plane")
        buffer, layout = pack(self.logic.supervise(tensors, vid))
        seq = session.take_seq()
        meta = {"seq": seq, "nbytes": int(buffer.numel()), "layout": layout, "vocab_id": vid}
        return Response.json(meta, after=lambda: session.send(seq, buffer),
                             failed=lambda: session.order.breaks(f"answer {seq} was not delivered"))

    def drop(self, sid: str) -> None:
        with self._lock:
            session = self.sessions.pop(sid, None)
        if session is not None:
            session.order.breaks("closed")

    def close_client(self, client: str) -> None:
        with self._lock:
            sids = [s.sid for s in self.sessions.values() if s.client == client]
        for sid in sids:
            self.drop(sid)

    def close(self) -> None:
        with self._lock:
            sids = list(self.sessions)
        for sid in sids:
            self.drop(sid)


# ----------------------------------------------------------------------------- client side

def _store_class():
    import torch.distributed as dist

    class HTTPStore(dist.Store):
        """The client's view of the server's rendezvous store, through /v1/data_plane/store."""

        def __init__(self, remote, server, sid: str):
            super().__init__()
            self.remote, self.server, self.sid = remote, server, sid

        def _op(self, **request) -> dict:
            _, answer = self.remote._call("POST", "/v1/data_plane/store",
                                          wire.dumps({"session": self.sid, **request}),
                                          server=self.server, what="the data-plane rendezvous")
            return answer

        def set(self, key, value):
            raw = value.encode() if isinstance(value, str) else bytes(value)
            self._op(op="set", key=key, value=base64.b64encode(raw).decode())

        def get(self, key):
            return base64.b64decode(self._op(op="get", key=key)["value"])

        def wait(self, keys, timeout=None):
            for key in keys:
                self._op(op="wait", key=key)

        def check(self, keys):
            return all(self._op(op="check", key=key)["ok"] for key in keys)

        def add(self, key, amount):
            return self._op(op="add", key=key, amount=int(amount))["value"]

    return HTTPStore


class DataPlaneError(RuntimeError):
    """The data plane broke; the caller repeats the request over the HTTP body."""


class ClientDataPlane:
    def __init__(self, server, sid: str, group, timeout: float):
        self.server, self.sid, self.group = server, sid, group
        self.order = _Ordered(timeout)

    @classmethod
    def negotiate(cls, remote, server, backend: str) -> "ClientDataPlane | None":
        """A data plane to `server`, or None (with a warning) when it cannot be had."""
        from spec_cli.target.remote_backend import RemoteError

        if backend not in server.info.get("data_plane", []):
            log.warning("%s offers no %s data plane (start it with --data-plane); using the HTTP body",
                        server.url, backend)
            return None
        try:
            _, answer = remote._call("POST", "/v1/data_plane", wire.dumps({"backend": backend}),
                                     server=server, what="the data-plane setup")
            conn, _ = remote._connection(server)
            hostname = conn.sock.getsockname()[0]  # the address this machine reaches the server from
            store = _store_class()(remote, server, answer["session"])
            group = _gloo_group(store, 1, hostname, float(answer.get("timeout_s", 60.0)))
        except (RemoteError, RuntimeError, KeyError, OSError) as exc:
            log.warning("%s: the %s data plane did not form (%s); using the HTTP body", server.url,
                        backend, exc)
            return None
        return cls(server, answer["session"], group, float(answer.get("timeout_s", 60.0)))

    def receive(self, meta: dict) -> dict[str, torch.Tensor]:
        try:
            seq, nbytes, layout = int(meta["seq"]), int(meta["nbytes"]), meta["layout"]
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self.order.run(seq, lambda: self.group.recv([buffer], 0, seq).wait())
            return unpack(buffer, layout)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            self.order.breaks(str(exc))
            raise DataPlaneError(f"{self.server.url}: data plane transfer failed: {exc}") from exc

    @property
    def broken(self) -> bool:
        return self.order.broken is not None

    def close(self) -> None:
        self.order.breaks("closed")
        self.group = None
