"""The tensor plane of `spec serve-target`: supervision tensors over torch.distributed send/recv.

HTTP keeps the control messages (the request, its validation, errors); when client and server can
join a process group, a generate's answer is only the JSON header of the tensor message (names,
dtypes, shapes) and the tensors follow over a two-rank process group, one per client thread:

    client                                   server
    POST /v1/plane {"backend"}        ->     opens channel C (rank 0, in a thread)
                                      <-     {"channel": C, "port", "backend"}
    joins C (rank 1) via the TCPStore on the server's plane port
    POST /v1/generate (meta: plane C) ->     runs the target
                                      <-     JSON {"tensors": [[name, dtype, shape], ...], "tag"}
    posts a recv per tensor (tag)     <-     sends each tensor after the HTTP answer is flushed

NCCL between GPU hosts (the tensors never leave the GPUs: this is the case the plane exists for),
gloo otherwise (CPU tensors over TCP; on one machine it saves only HTTP's framing and copies).

Every channel belongs to one client thread, whose requests are sequential, so NCCL's in-order
matching holds; gloo matches by tag as well. A channel that fails once (a peer gone, a timeout) is
dropped by both sides and never reused: the client retries the request on a new channel or over
HTTP bodies. The rendezvous store and gloo's sockets bind the server's --host; a channel's name is
random and handed out only over the (token-checked) HTTP control plane.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spec_cli.batch import parse_tensor_header, tensor_header
from spec_cli.serve import wire

log = logging.getLogger(__name__)

PREFIX = "spec-plane/"
MAX_CHANNELS = 256  # open channels per server (each is a two-rank process group)
TAG_STRIDE = wire.MAX_TENSORS  # tag of tensor i of request n: n * TAG_STRIDE + i
TAG_WRAP = 1 << 20


class PlaneError(RuntimeError):
    """A transfer over the tensor plane failed (peer gone, timeout): the channel is dead."""


def backends() -> list[str]:
    """The process-group backends this process can run a channel on ("gloo" always, "nccl" with CUDA)."""
    out = ["gloo"] if dist.is_gloo_available() else []
    if torch.cuda.is_available() and dist.is_nccl_available():
        out.append("nccl")
    return out


def pair(store: dist.Store, rank: int, backend: str, address: str,
         timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A two-rank process group of `backend` through `store`; gloo's sockets bind `address`."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"unknown tensor-plane backend {backend!r}")


def header(tensors: dict[str, torch.Tensor]) -> list[list]:
    """The tensor message's header without data (batch.tensor_header): what an answer announces."""
    return tensor_header(tensors)


def parse_header(entries) -> list[tuple[str, torch.dtype, list[int]]]:
    """An answer's announced tensors, checked (WireError, as wire.decode raises, on anything else)."""
    try:
        return parse_tensor_header(entries)
    except ValueError as exc:
        raise wire.WireError(str(exc)) from None


@dataclass
class Channel:
    """One end of a client thread's two-rank group: rank 0 (server) sends, rank 1 (client) receives."""

    name: str
    group: dist.ProcessGroup
    backend: str
    device: torch.device  # where tensors travel: CPU for gloo, the GPU for NCCL
    timeout: float

    def _wait(self, works, what: str) -> None:
        try:
            for work in works:
                if not work.wait(datetime.timedelta(seconds=self.timeout)):
                    raise PlaneError(f"{what} did not finish within {self.timeout:g} s")
        except PlaneError:
            raise
        except RuntimeError as exc:  # gloo: "Connection closed by peer", a timeout; NCCL: an abort
            raise PlaneError(f"{what} failed: {str(exc).splitlines()[0][:300]}") from None

    def send(self, tensors: dict[str, torch.Tensor], tag: int) -> None:
        """Send every tensor (contiguous, on this channel's device) to the client, in order."""
        buffers = [t.detach().to(self.device).contiguous() for t in tensors.values()]
        base = (tag % TAG_WRAP) * TAG_STRIDE
        works = [self.group.send([t], 1, base + i) for i, t in enumerate(buffers) if t.numel()]
        self._wait(works, "sending the supervision over the tensor plane")

    def recv(self, specs: list[tuple[str, torch.dtype, list[int]]], tag: int) -> dict[str, torch.Tensor]:
        """Receive the tensors `specs` names (the answer's header), sent by `send` with the same tag."""
        out = {name: torch.empty(shape, dtype=dtype, device=self.device) for name, dtype, shape in specs}
        base = (tag % TAG_WRAP) * TAG_STRIDE
        works = [self.group.recv([t], 0, base + i) for i, t in enumerate(out.values()) if t.numel()]
        self._wait(works, "receiving the supervision over the tensor plane")
        if self.device.type == "cuda":  # the batch is read by the trainer's thread, on its own stream
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def close(self) -> None:
        try:
            self.group.abort() if self.backend == "nccl" else self.group.shutdown()
        except (RuntimeError, AttributeError):
            pass


class PlaneHost:
    """The server's end: the rendezvous store on (host, port) and one channel per client thread.

    A join answers at once; the channel's rank 0 is made in a thread and waited for by the first
    generate that names it (up to `timeout` seconds)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 120.0,
                 device: torch.device | str | None = None):
        self.host, self.timeout = host, timeout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:  # set_device needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)
        self.port = sock.getsockname()[1]
        # the store takes the bound socket (and closes it): it listens on --host only
        self.store = dist.TCPStore(host, self.port, None, True, datetime.timedelta(seconds=timeout),
                                   wait_for_workers=False, master_listen_fd=sock.detach())
        self.backends = [b for b in backends() if b != "nccl" or self.device.type == "cuda"]
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[str, threading.Event, list]] = {}  # name -> (client, ready, [Channel])
        self._tags: dict[str, int] = {}

    def info(self) -> dict:
        return {"port": self.port, "backends": self.backends}

    def open(self, client: str | None, backend: str, address: str) -> dict:
        """Start a channel for one client thread; `address` is this server's address as the client
        reached it (gloo binds it). The answer tells the client how to join."""
        if backend not in self.backends:
            return {"channel": None, "reason": f"this server runs no {backend} tensor plane "
                                               f"(it has {', '.join(self.backends) or 'none'})"}
        with self._lock:
            if len(self._channels) >= MAX_CHANNELS:
                return {"channel": None, "reason": f"the server has {MAX_CHANNELS} channels open"}
            name = secrets.token_hex(16)
            ready, holder = threading.Event(), []
            self._channels[name] = (client or "", ready, holder)
        device = self.device if backend == "nccl" else torch.device("cpu")

        def make() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                group = pair(dist.PrefixStore(PREFIX + name, self.store), 0, backend, address,
                             datetime.timedelta(seconds=self.timeout))
                holder.append(Channel(name, group, backend, device, self.timeout))
            except Exception as exc:  # the client never joined, or could not: the channel is gone
                log.info("tensor-plane channel %s not opened: %s", name[:8], exc)
                self.drop(name)
            finally:
                ready.set()

        threading.Thread(target=make, name=f"spec-plane-{name[:8]}", daemon=True).start()
        return {"channel": name, "port": self.port, "backend": backend}

    def get(self, name: str) -> Channel | None:
        """The open channel `name` (waiting for its rendezvous), or None when there is none."""
        with self._lock:
            entry = self._channels.get(name)
        if entry is None:
            return None
        _, ready, holder = entry
        ready.wait(self.timeout)
        return holder[0] if holder else None

    def next_tag(self, name: str) -> int:
        with self._lock:
            self._tags[name] = tag = self._tags.get(name, -1) + 1
            return tag

    def drop(self, name: str) -> None:
        with self._lock:
            entry = self._channels.pop(name, None)
            self._tags.pop(name, None)
        if entry is not None and entry[2]:
            entry[2][0].close()

    def drop_client(self, client: str | None) -> None:
        """Close every channel of a client (its goodbye)."""
        with self._lock:
            names = [n for n, (c, _, _) in self._channels.items() if c == (client or "")]
        for name in names:
            self.drop(name)

    def close(self) -> None:
        with self._lock:
            names = list(self._channels)
        for name in names:
            self.drop(name)
