"""Request handling of the target server, independent of any transport (testable without sockets).

`TargetServer.handle(method, path, headers, body)` takes one request and returns one `Response`;
`spec_cli.serve.http` only moves bytes. Every input is checked before it reaches the model and a bad
one is answered with a 4xx and a JSON `{"error": ...}` saying what is wrong; the server keeps serving.

Endpoints (all under /v1; every request carries `Authorization: Bearer TOKEN` when a token is set):

| method | path | body -> answer |
| --- | --- | --- |
| GET  | /health           | -> JSON {"status": "ok", "protocol"} |
| GET  | /info             | -> JSON: architecture, vocab/hidden size, aux layers, fingerprints, |
|      |                   |    target config, limits |
| GET  | /tokenizer        | -> JSON {"files": {name: text}} (the trainer tokenises its data with it; a |
|      |                   |    vision-language target's processor files too) |
| GET  | /input_embeddings | -> tensors {"weight": [V, H]} (seeds the draft, once) |
| POST | /vocab_mapping    | tensors {"selected_token_ids": [Vd] int64} -> JSON {"vocab_id"} |
| POST | /output_head      | JSON {"vocab_id"} -> tensors {"lm_head_selected" [Vd, H] [, "final_norm" [H]]} |
| POST | /generate         | tensors {input_ids, attention_mask, loss_mask [, position_ids, seq_lens] |
|      |                   |    [, images.NAME: an image-text batch's image inputs]} |
|      |                   | + {"vocab_id"} -> tensors: exactly the TargetBatch (draft-vocab supervision) |
| POST | /plane            | JSON {"backend"} -> JSON {"channel", "port", "backend"} (or {"channel": null, |
|      |                   |    "reason"}): a tensor-plane channel for one client thread (plane.py) |
| POST | /disconnect       | -> JSON {"ok": true}; with exit_on_disconnect the last client's stops it |

A generate sent with `X-Spec-Plane: CHANNEL` is answered with JSON {"plane", "tag", "tensors": [[name,
dtype, shape], ...]} and the tensors follow over that channel once the answer is flushed (plane.py).

One generate runs on the model at a time (a lock); requests wait their turn.
"""

from __future__ import annotations

import hmac
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from spec_cli.errors import SpecError
from spec_cli.serve import plane as plane_module
from spec_cli.serve import wire

log = logging.getLogger(__name__)

GENERATE_TENSORS = ("input_ids", "attention_mask", "loss_mask", "position_ids", "seq_lens")
IMAGES = (
    "images."  # the prefix of an image-text batch's image inputs (pixel values, grids, token types)
)
KEPT_VOCAB_MAPS = 8  # draft vocabs remembered at once (several trainers may share a server)
MAX_CLIENTS = 4096  # client ids tracked for exit_on_disconnect


@dataclass
class Limits:
    """Bounds on one request (the CLI exposes each as an option)."""

    max_batch_tokens: int = 65536  # B x T of one generate
    max_batch_size: int = 1024  # B of one generate
    max_seq_len: int = 32768  # T of one generate (also <= the target's max_position_embeddings)
    max_body_bytes: int = 64 << 20  # bytes of one request body


@dataclass
class Response:
    status: int
    content_type: str
    parts: list  # buffers written one after the other
    nbytes: int
    close: bool = False  # close the connection after answering (errors: the stream may be unread)
    headers: dict = field(default_factory=dict)
    after: Callable[[], None] | None = None  # run once the response is flushed (the last goodbye)

    @classmethod
    def json(cls, obj: dict, status: int = 200, **kw) -> Response:
        body = wire.dumps(obj)
        return cls(status, wire.JSON_TYPE, [body], len(body), **kw)

    @classmethod
    def tensors(cls, encoded: wire.Encoded, **kw) -> Response:
        return cls(200, wire.TENSOR_TYPE, encoded.parts, encoded.nbytes, **kw)

    def body(self) -> bytes:
        return b"".join(bytes(p) for p in self.parts)


class RequestError(Exception):
    """A request the server refuses: answered with `status` and a JSON error, never a traceback."""

    def __init__(self, status: int, message: str, code: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code  # names a 409's cause for the client: "vocab"
        self.hint = hint  # what the client can do about it (a 422: what the target refuses)


def _bad(message: str) -> RequestError:
    return RequestError(400, message)


# ----------------------------------------------------------------------------- validation


def _int64(name: str, t: torch.Tensor, ndim: int) -> torch.Tensor:
    if t.dtype != torch.int64:
        raise _bad(f"{name} must be int64, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise _bad(f"{name} must have {ndim} dimensions, got shape {list(t.shape)}")
    return t


def _binary(name: str, t: torch.Tensor) -> None:
    if t.numel() and not bool(((t == 0) | (t == 1)).all()):
        raise _bad(f"{name} must hold only 0 and 1")


def validate_generate(
    tensors: dict[str, torch.Tensor], vocab_size: int, limits: Limits, max_positions: int | None
) -> dict[str, torch.Tensor | None]:
    """The keyword arguments of generate_batch, or RequestError(400) naming the first problem."""
    images = {name[len(IMAGES) :]: t for name, t in tensors.items() if name.startswith(IMAGES)}
    for (
        name,
        t,
    ) in images.items():  # image-text rows: the model inputs of their images (data/vlm.py)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name):
            raise _bad(f"bad image input name {name[:40]!r}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _bad(f"image input {name} holds NaN or infinite values")
    unknown = sorted(set(tensors) - set(GENERATE_TENSORS) - {IMAGES + n for n in images})
    if unknown:
        raise _bad(
            f"unknown tensor(s) {unknown}; a generate request holds {list(GENERATE_TENSORS)}"
        )
    missing = [n for n in GENERATE_TENSORS[:3] if n not in tensors]
    if missing:
        raise _bad(f"missing tensor(s) {missing}")
    ids = _int64("input_ids", tensors["input_ids"], 2)
    B, T = ids.shape
    if B < 1 or T < 1:
        raise _bad(f"input_ids is empty (shape {[B, T]})")
    if B > limits.max_batch_size:
        raise _bad(f"batch of {B} rows exceeds the server's limit of {limits.max_batch_size}")
    if T > limits.max_seq_len:
        raise _bad(f"sequence length {T} exceeds the server's limit of {limits.max_seq_len}")
    if B * T > limits.max_batch_tokens:
        raise _bad(
            f"batch of {B} x {T} = {B * T} tokens exceeds the server's limit of "
            f"{limits.max_batch_tokens}"
        )
    for name in ("attention_mask", "loss_mask", "position_ids"):
        if name in tensors and list(_int64(name, tensors[name], 2).shape) != [B, T]:
            raise _bad(f"{name} has shape {list(tensors[name].shape)}, input_ids has {[B, T]}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise _bad(
            f"input_ids must lie in [0, {vocab_size}) (the target's vocab), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    am, lm = tensors["attention_mask"], tensors["loss_mask"]
    _binary("attention_mask", am)
    _binary("loss_mask", lm)
    if bool((lm > am).any()):
        raise _bad("loss_mask is 1 where attention_mask is 0 (padding cannot be supervised)")
    if not bool(am.any(dim=1).all()):
        raise _bad("a row has no real token (attention_mask all 0)")
    position_ids = tensors.get("position_ids")
    if position_ids is not None:
        top = max_positions or limits.max_seq_len
        if int(position_ids.min()) < 0 or int(position_ids.max()) >= top:
            raise _bad(f"position_ids must lie in [0, {top})")
    seq_lens = tensors.get("seq_lens")
    if seq_lens is not None:
        _int64("seq_lens", seq_lens, 2)
        if seq_lens.shape[0] != B or not 1 <= seq_lens.shape[1] <= T:
            raise _bad(
                f"seq_lens must have shape [{B}, D] with 1 <= D <= {T}, got {list(seq_lens.shape)}"
            )
        if int(seq_lens.min()) < 0:
            raise _bad("seq_lens must be non-negative")
        total = seq_lens.sum(dim=1)  # [B]
        if bool((total > T).any()):
            raise _bad(f"seq_lens of a row sum to more than the row length {T}")
        real = torch.arange(T).unsqueeze(0) < total.unsqueeze(1)  # [B, T]
        if not torch.equal(real.long(), am):
            raise _bad(
                "attention_mask must be 1 exactly on the first sum(seq_lens) tokens of each row"
            )
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": lm,
        "position_ids": position_ids,
        "seq_lens": seq_lens,
        **({"images": images} if images else {}),
    }


def validate_vocab_mapping(tensors: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor:
    if set(tensors) != {"selected_token_ids"}:
        raise _bad(
            f"a vocab mapping holds exactly one tensor 'selected_token_ids', got {sorted(tensors)}"
        )
    ids = _int64("selected_token_ids", tensors["selected_token_ids"], 1)
    if not 1 <= ids.numel() <= vocab_size:
        raise _bad(f"selected_token_ids must hold 1..{vocab_size} ids, got {ids.numel()}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise _bad(f"selected_token_ids must lie in [0, {vocab_size}) (the target's vocab)")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise _bad("selected_token_ids must be strictly ascending (sorted, no repeats)")
    return ids.clone()


# ----------------------------------------------------------------------------- the server logic


class TargetServer:
    """Answers supervision requests with a loaded target backend (HFTargetBackend or alike).

    `target_config` (the target's config.to_dict()) and `tokenizer_files` ({name: text}) let a
    trainer that has neither build its draft and tokenise its data; both are optional.
    """

    def __init__(
        self,
        backend,
        *,
        target_config: dict | None = None,
        tokenizer_files: dict[str, str] | None = None,
        token: str | None = None,
        limits: Limits | None = None,
        exit_on_disconnect: bool = False,
        fields: dict | None = None,
        plane=None,
    ):
        self.backend = backend
        self.plane = plane  # a PlaneHost: supervision tensors over torch.distributed (None: HTTP bodies only)
        self.fields = dict(
            fields or {}
        )  # name -> TargetField: the per-token fields a trainer may ask for
        self.target_config = target_config
        self.tokenizer_files = tokenizer_files
        self.token = token or None
        self.limits = replace(limits or Limits())  # a copy: max_seq_len is capped below
        self.vocab_size = int(backend.info["vocab_size"])
        self.max_positions = (target_config or {}).get("max_position_embeddings") or (
            (target_config or {}).get("text_config") or {}
        ).get("max_position_embeddings")
        if self.max_positions:
            self.limits.max_seq_len = min(self.limits.max_seq_len, int(self.max_positions))
        self.exit_on_disconnect = exit_on_disconnect
        self.shutdown_event = threading.Event()
        self.generate_lock = threading.Lock()  # one forward on the model at a time
        self._state_lock = threading.Lock()
        self._vocab_maps: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._active_vocab: str | None = None
        self._clients: set[str] = set()
        self.routes: dict[str, tuple[str, Callable]] = {
            "/v1/health": ("GET", self.health),
            "/v1/info": ("GET", self.model_info),
            "/v1/tokenizer": ("GET", self.tokenizer),
            "/v1/input_embeddings": ("GET", self.input_embeddings),
            "/v1/vocab_mapping": ("POST", self.set_vocab_mapping),
            "/v1/output_head": ("POST", self.output_head),
            "/v1/generate": ("POST", self.generate),
            "/v1/plane": ("POST", self.open_plane),
            "/v1/disconnect": ("POST", self.disconnect),
        }

    # ------------------------------------------------------------------ dispatch
    def handle(
        self, method: str, path: str, headers, body: bytes | bytearray, address: str | None = None
    ) -> Response:
        """One request -> one response. Never raises: errors become 4xx/5xx JSON answers.

        `address`: this server's address as the client reached it (a tensor-plane channel binds it)."""
        try:
            return self._handle(method, path.split("?", 1)[0], headers, body, address)
        except RequestError as exc:
            log.info("%s %s -> %d %s", method, path, exc.status, exc.message)
            extra = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
            answer = {"error": exc.message, "status": exc.status, "code": exc.code}
            if exc.hint:
                answer["hint"] = exc.hint
            return Response.json(answer, exc.status, close=exc.status != 409, headers=extra)
        except wire.WireError as exc:
            return Response.json({"error": str(exc), "status": 400}, 400, close=True)
        except Exception as exc:  # the model failed (e.g. out of memory): say so, keep serving
            log.exception("%s %s failed", method, path)
            return Response.json(
                {"error": f"internal error: {type(exc).__name__}: {exc}", "status": 500},
                500,
                close=True,
            )

    def _handle(self, method, path, headers, body, address=None) -> Response:
        lowered = {str(k).lower(): v for k, v in headers.items()}  # header names ignore case

        def get(name: str) -> str | None:
            return lowered.get(name.lower())

        if not self.authorized(get("Authorization")):
            raise RequestError(401, "missing or wrong token (send `Authorization: Bearer TOKEN`)")
        if self.shutdown_event.is_set() and path != "/v1/health":
            raise RequestError(503, "the server is shutting down")
        if len(body) > self.limits.max_body_bytes:
            raise RequestError(
                413, f"body of {len(body)} bytes exceeds the limit of {self.limits.max_body_bytes}"
            )
        if path not in self.routes:
            raise RequestError(404, f"no endpoint {path!r}; see /v1/info")
        allowed, handler = self.routes[path]
        if method != allowed:
            raise RequestError(405, f"{path} takes {allowed}, not {method}")
        client = get("X-Spec-Client")
        if client:
            if len(client) > 64:
                raise _bad("X-Spec-Client is longer than 64 characters")
            with self._state_lock:
                if path != "/v1/disconnect" and len(self._clients) < MAX_CLIENTS:
                    self._clients.add(client)
        return handler(body, client=client, address=address, plane=get("X-Spec-Plane"))

    def authorized(self, header: str | None) -> bool:
        """Whether an Authorization header carries the token (always, when none is set)."""
        if self.token is None:
            return True
        expected = f"Bearer {self.token}".encode()
        given = (header or "").encode("utf-8", "replace")
        return hmac.compare_digest(given, expected)  # constant time in the token's content

    # ------------------------------------------------------------------ endpoints
    def health(self, body, **_) -> Response:
        return Response.json({"status": "ok", "protocol": wire.PROTOCOL})

    def info(self) -> dict:
        return {
            "protocol": wire.PROTOCOL,
            **self.backend.info,
            "target_config": self.target_config,
            "limits": asdict(self.limits),
            "has_tokenizer": self.tokenizer_files is not None,
            "reads_images": bool(getattr(self.backend, "reads_images", False)),
            "plane": self.plane.info() if self.plane is not None else None,
            "vocab_ids": list(self._vocab_maps),
        }

    def model_info(self, body, **_) -> Response:
        return Response.json(self.info())

    def tokenizer(self, body, **_) -> Response:
        if self.tokenizer_files is None:
            raise RequestError(404, "this server has no tokenizer to share")
        return Response.json(
            {
                "files": self.tokenizer_files,
                "tokenizer_fingerprint": self.backend.info.get("tokenizer_fingerprint"),
            }
        )

    def input_embeddings(self, body, **_) -> Response:
        return Response.tensors(wire.encode({"weight": self.backend.get_input_embeddings()}))

    def set_vocab_mapping(self, body, **_) -> Response:
        tensors, _meta = wire.decode(bytearray(body))
        ids = validate_vocab_mapping(tensors, self.vocab_size)
        vid = wire.vocab_id(ids)
        with self.generate_lock:
            self.backend.set_vocab_mapping(ids)
            self._active_vocab = vid
            self._vocab_maps[vid] = ids
            self._vocab_maps.move_to_end(vid)
            while len(self._vocab_maps) > KEPT_VOCAB_MAPS:
                self._vocab_maps.popitem(last=False)
        return Response.json({"vocab_id": vid, "draft_vocab_size": int(ids.numel())})

    def _use_vocab(self, vid) -> None:
        """Under generate_lock: make `vid` the backend's active vocab mapping."""
        if not isinstance(
            vid, str
        ):  # a list or number would fail as a dict key: the request's fault
            raise _bad(
                f"vocab_id must be a string (the id /v1/vocab_mapping answered), got "
                f"{type(vid).__name__}"
            )
        if vid not in self._vocab_maps:
            raise RequestError(
                409,
                f"unknown vocab_id {vid!r}: send the vocab mapping first (POST /v1/vocab_mapping)",
                code="vocab",
            )
        if vid != self._active_vocab:  # another trainer switched it: switch back (cheap)
            self.backend.set_vocab_mapping(self._vocab_maps[vid])
            self._active_vocab = vid

    def output_head(self, body, **_) -> Response:
        vid = wire.loads(body).get("vocab_id")
        with self.generate_lock:
            self._use_vocab(vid)
            head = self.backend.get_output_head()
        if head is None:
            raise RequestError(404, "this target has no output head to share")
        return Response.tensors(
            wire.encode({k: v.detach().cpu().contiguous() for k, v in head.items()})
        )

    def supervise(
        self,
        tensors: dict[str, torch.Tensor],
        vid,
        final_hidden: bool = False,
        extras: tuple[str, ...] = (),
    ) -> dict[str, torch.Tensor]:
        """Validate one generate request and run the target on it (under the model lock); with
        final_hidden the answer carries the target's final hidden states too (EAGLE-1/2 trainers), and
        each of `extras` as `extra.NAME` (the per-token fields of the draft algorithm served)."""
        kwargs = validate_generate(tensors, self.vocab_size, self.limits, self.max_positions)
        if "images" in kwargs and not getattr(self.backend, "reads_images", False):
            raise RequestError(
                422,
                "this server's target does not run its vision encoder on image-text rows",
                hint="serve the target with --target-engine transformers",
            )
        unknown = [name for name in extras if name not in self.fields]
        if unknown:
            raise RequestError(
                422,
                f"this server computes no per-token field {', '.join(unknown)}",
                hint="start `spec serve-target` with the --algorithm the trainer trains",
            )
        with self.generate_lock:
            self._use_vocab(vid)
            self.backend.keep_final_hidden = bool(final_hidden)
            self.backend.extra_fields = {name: self.fields[name] for name in extras}
            try:
                return self.backend.generate_batch(**kwargs).tensors()
            except SpecError as exc:  # a request this target cannot answer exactly (e.g. packing)
                raise RequestError(422, exc.message, hint=exc.hint) from None

    def open_plane(self, body, client=None, address=None, **_) -> Response:
        if self.plane is None:
            return Response.json(
                {
                    "channel": None,
                    "reason": "the server runs without a tensor plane (--no-tensor-plane)",
                }
            )
        backend = wire.loads(body).get("backend", "gloo")
        if not isinstance(backend, str):
            raise _bad("backend must be a string (gloo or nccl)")
        return Response.json(self.plane.open(client, backend, address or self.plane.host))

    def generate(self, body, plane=None, **_) -> Response:
        tensors, meta = wire.decode(body if isinstance(body, bytearray) else bytearray(body))
        if not isinstance(meta, dict):
            raise _bad(f"the request's metadata must be a JSON object, got {type(meta).__name__}")
        if "final_hidden" in meta and not isinstance(meta["final_hidden"], bool):
            raise _bad(
                f"final_hidden must be true or false, got {type(meta['final_hidden']).__name__}"
            )
        extras = meta.get("extras", [])
        if not isinstance(extras, list) or not all(isinstance(name, str) for name in extras):
            raise _bad("extras must be a list of field names")
        channel = None
        if plane is not None:  # checked before the target runs: a lost channel costs no forward
            channel = self.plane.get(plane) if self.plane is not None else None
            if channel is None:
                raise RequestError(
                    409,
                    f"no tensor-plane channel {plane[:16]!r} (the server restarted, or "
                    "the channel failed): open a new one",
                    code="plane",
                )
        out = self.supervise(
            tensors,
            meta.get("vocab_id"),
            final_hidden=meta.get("final_hidden") is True,
            extras=tuple(extras),
        )
        if channel is None:
            return Response.tensors(wire.encode(out, {"vocab_id": meta.get("vocab_id")}))
        tag = self.plane.next_tag(channel.name)

        def send() -> (
            None
        ):  # after the answer is flushed: the client posts its receives on reading it
            try:
                channel.send(out, tag)
            except Exception as exc:  # noqa: BLE001 - whatever failed, this channel's peer is out of step
                log.info("tensor plane: %s; channel %s closed", exc, channel.name[:8])
                self.plane.drop(channel.name)

        return Response.json(
            {
                "plane": channel.name,
                "tag": tag,
                "tensors": plane_module.header(out),
                "vocab_id": meta.get("vocab_id"),
            },
            after=send,
        )

    def disconnect(self, body, client=None, **_) -> Response:
        with self._state_lock:
            self._clients.discard(client)
            last = not self._clients
        if self.plane is not None:
            self.plane.drop_client(client)
        if self.exit_on_disconnect and last:
            log.info("the last client disconnected: shutting down")
            return Response.json(
                {"ok": True, "shutting_down": True}, close=True, after=self.shutdown_event.set
            )
        return Response.json({"ok": True, "shutting_down": False})

    def close(self) -> None:
        self.shutdown_event.set()
        if self.plane is not None:
            self.plane.close()
