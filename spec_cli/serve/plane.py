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
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spec_cli.batch import parse_tensor_header, tensor_header
from spec_cli.serve import wire

log = logging.getLogger(__name__)

PREFIX = "spec-plane/"
MAX_CHANNELS = 256  # open channels per server (each is a two-rank process group)
TAG_STRIDE = wire.MAX_TENSORS  # tag of tensor i of request n: n * TAG_STRIDE + i
TAG_WRAP = 1 << 20
IDLE_SECONDS = (
    3600.0  # a channel unused this long is closed (its client is gone, or will reopen one)
)
# How a channel's NCCL group meets a failed or timed-out transfer: abort that communicator and leave the
# process up (torch's default, 3, ends the process: a trainer gone mid-transfer would take the server with
# it), and no flight-recorder dump or heartbeat monitor (a monitor may end the process after a dump)
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
_ENV_LOCK = threading.Lock()


class PlaneError(RuntimeError):
    """A transfer over the tensor plane failed (peer gone, timeout): the channel is dead."""


def backends() -> list[str]:
    """The process-group backends this process can run a channel on ("gloo" always, "nccl" with CUDA)."""
    out = ["gloo"] if dist.is_gloo_available() else []
    if torch.cuda.is_available() and dist.is_nccl_available():
        out.append("nccl")
    return out


def pair(
    store: dist.Store,
    rank: int,
    backend: str,
    address: str,
    timeout: datetime.timedelta,
    connect: datetime.timedelta | None = None,
) -> dist.ProcessGroup:
    """A two-rank process group of `backend` through `store`; gloo's sockets bind `address`.

    `connect` bounds the rendezvous (gloo connects in the constructor; default `timeout`), `timeout`
    each transfer after it. An NCCL group is made with NCCL_ENV, so that a failed transfer aborts this
    group only, never the process (the server's other clients, the trainer's run)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = connect or timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        group = dist.ProcessGroupGloo(store, rank, 2, options)
        if connect is not None and connect != timeout:
            group.set_timeout(timeout)
        return group
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with _ENV_LOCK:  # read by the group's constructor; the process's own groups keep theirs
            before = {name: os.environ.get(name) for name in NCCL_ENV}
            os.environ.update(NCCL_ENV)
            try:
                return dist.ProcessGroupNCCL(store, rank, 2, options)
            finally:
                for name, value in before.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
    raise ValueError(f"unknown tensor-plane backend {backend!r}")


def gpu_identity(device: torch.device) -> str | None:
    """The GPU's UUID (two ranks of one NCCL group cannot share a GPU), or None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


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
    last_used: float = field(default_factory=time.monotonic)  # the server closes long-idle channels

    def _failed(self, what: str, exc: Exception) -> PlaneError:
        return PlaneError(
            f"{what} failed: {(str(exc).splitlines() or [type(exc).__name__])[0][:300]}"
        )

    def _wait(self, works, what: str) -> None:
        """Wait for every posted transfer, `timeout` seconds at most. On NCCL, wait() only orders the
        current stream after the transfer, so completion is polled on the host instead: a peer gone
        mid-transfer is an error after the timeout, not a stream that never finishes."""
        deadline = time.monotonic() + self.timeout
        try:
            if self.backend == "nccl":
                while not all(work.is_completed() for work in works):
                    if time.monotonic() > deadline:
                        raise PlaneError(f"{what} did not finish within {self.timeout:g} s")
                    time.sleep(0.0005)
                for work in works:  # raises the communicator's error, if it failed
                    work.wait()
                return
            for work in works:
                if not work.wait(
                    datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
                ):
                    raise PlaneError(f"{what} did not finish within {self.timeout:g} s")
        except PlaneError:
            raise
        except RuntimeError as exc:  # gloo: "Connection closed by peer", a timeout; NCCL: an abort
            raise self._failed(what, exc) from None

    def _post(self, post, peer: int, tensors: list[torch.Tensor], base: int, what: str) -> list:
        """One send or recv per non-empty tensor; an error while posting (NCCL's communicator
        refusing, an aborted group) is a failed channel like an error while waiting."""
        try:
            return [post([t], peer, base + i) for i, t in enumerate(tensors) if t.numel()]
        except RuntimeError as exc:
            raise self._failed(what, exc) from None

    def send(self, tensors: dict[str, torch.Tensor], tag: int) -> None:
        """Send every tensor (contiguous, on this channel's device) to the client, in order."""
        self.last_used = time.monotonic()
        what = "sending the supervision over the tensor plane"
        buffers = [t.detach().to(self.device).contiguous() for t in tensors.values()]
        self._wait(
            self._post(self.group.send, 1, buffers, (tag % TAG_WRAP) * TAG_STRIDE, what), what
        )

    def recv(
        self, specs: list[tuple[str, torch.dtype, list[int]]], tag: int
    ) -> dict[str, torch.Tensor]:
        """Receive the tensors `specs` names (the answer's header), sent by `send` with the same tag."""
        self.last_used = time.monotonic()
        what = "receiving the supervision over the tensor plane"
        out = {
            name: torch.empty(shape, dtype=dtype, device=self.device)
            for name, dtype, shape in specs
        }
        self._wait(
            self._post(self.group.recv, 0, list(out.values()), (tag % TAG_WRAP) * TAG_STRIDE, what),
            what,
        )
        if (
            self.device.type == "cuda"
        ):  # the batch is read by the trainer's thread, on its own stream
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

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 120.0,
        device: torch.device | str | None = None,
    ):
        self.host, self.timeout = host, timeout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:  # set_device needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)
        self.port = sock.getsockname()[1]
        # the store takes the bound socket (and closes it): it listens on --host only
        self.store = dist.TCPStore(
            host,
            self.port,
            None,
            True,
            datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
        )
        self.backends = [b for b in backends() if b != "nccl" or self.device.type == "cuda"]
        self._lock = threading.Lock()
        self._channels: dict[
            str, tuple[str, threading.Event, list]
        ] = {}  # name -> (client, ready, [Channel])
        self._tags: dict[str, int] = {}

    def info(self) -> dict:
        """What /v1/info offers: the rendezvous port, the backends, and the GPU an NCCL channel's
        end would use (a trainer on that same GPU takes gloo: NCCL cannot pair a GPU with itself)."""
        return {
            "port": self.port,
            "backends": self.backends,
            "gpu": gpu_identity(self.device) if "nccl" in self.backends else None,
        }

    def _reap(self) -> None:
        """Close channels unused for IDLE_SECONDS (a trainer gone without its goodbye), and when the
        server is full the least recently used one idle past `timeout` (its client reopens one)."""
        now = time.monotonic()
        with self._lock:
            idle = sorted(
                (holder[0].last_used, name)
                for name, (_, _, holder) in self._channels.items()
                if holder
            )
        gone = [(used, name) for used, name in idle if now - used > IDLE_SECONDS]
        if len(self._channels) - len(gone) >= MAX_CHANNELS:
            gone += [
                (used, name) for used, name in idle if IDLE_SECONDS >= now - used > self.timeout
            ][:1]
        for used, name in gone:
            log.info("tensor-plane channel %s closed: unused for %.0f s", name[:8], now - used)
            self.drop(name)

    def open(self, client: str | None, backend: str, address: str) -> dict:
        """Start a channel for one client thread; `address` is this server's address as the client
        reached it (gloo binds it). The answer tells the client how to join."""
        if backend not in self.backends:
            return {
                "channel": None,
                "reason": f"this server runs no {backend} tensor plane "
                f"(it has {', '.join(self.backends) or 'none'})",
            }
        self._reap()
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
                group = pair(
                    dist.PrefixStore(PREFIX + name, self.store),
                    0,
                    backend,
                    address,
                    datetime.timedelta(seconds=self.timeout),
                )
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
        if not holder:
            return None
        holder[0].last_used = time.monotonic()  # in use from here: not idle while the target runs
        return holder[0]

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
