"""`spec serve-target`: load the target and answer supervision requests until stopped.

Stops on Ctrl-C / SIGTERM, or when the last client disconnects with `exit_on_disconnect`; requests in
progress finish first.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from spec_cli import assets
from spec_cli.console import info, warn
from spec_cli.data import chat_templates
from spec_cli.draft import algorithms
from spec_cli.errors import ConfigError, TargetError
from spec_cli.serve.http import HTTPHandle
from spec_cli.serve.plane import PlaneHost
from spec_cli.serve.server import Limits, TargetServer
from spec_cli.serve.wire import TOKEN_ENV
from spec_cli.targets import loading, local

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def tokenizer_files(tokenizer, processor=None) -> dict[str, str]:
    """The tokenizer as the text files save_pretrained writes ({name: text}); with a vision-language
    target's `processor`, its own files too (image processor settings, its chat template where the
    tokenizer has none): the trainer reads image-text chats with them (data/vlm.py)."""
    with tempfile.TemporaryDirectory(prefix="spec-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {
            p.name: p.read_text(encoding="utf-8")
            for p in sorted(Path(tmp).iterdir())
            if p.is_file()
        }
    if processor is not None:
        with tempfile.TemporaryDirectory(prefix="spec-proc-") as tmp:
            processor.save_pretrained(tmp)
            for p in sorted(Path(tmp).iterdir()):
                if (
                    p.is_file() and p.name not in files
                ):  # the tokenizer's (e.g. --chat-template) stay
                    files[p.name] = p.read_text(encoding="utf-8")
    return files


def _processor_or_none(target_dir: Path):
    """The target's processor to send trainers (image-text chats), or None; one that cannot load here
    (Qwen-VL's needs torchvision) leaves the server serving text, said once."""
    try:
        return loading.load_processor(target_dir)
    except TargetError as exc:
        warn(f"{exc.message}: trainers get the tokenizer only (text records); {exc.hint}")
        return None


def serve(
    target: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    aux_layers: str | list[int] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_batch_tokens: int = 65536,
    max_batch_size: int = 1024,
    max_seq_len: int = 32768,
    max_body_bytes: int = 64 << 20,
    request_timeout: float = 120.0,
    exit_on_disconnect: bool = False,
    on_ready: Callable[[str], None] | None = None,
    target_engine: str = "transformers",
    target_memory: float | None = None,
    target_tensor_parallel: int = 1,
    chat_template: str | None = None,
    algorithm: str | None = None,
    tensor_plane: bool = True,
    plane_port: int = 0,
) -> None:
    """Serve `target` over HTTP until Ctrl-C / SIGTERM (or the last client's disconnect).

    `token` (default: $SPEC_SERVE_TOKEN) is then required on every request. `port` 0 picks a free
    port; `on_ready(url)` is called once the server listens. `target_engine` runs the target in
    transformers or vLLM (the same supervision and target identity either way). `chat_template`
    (--chat-template) replaces the target's own in the tokenizer sent to trainers and in its fingerprint.
    `algorithm` (--algorithm) is the draft algorithm trained from it: it decides the aux layers and the
    per-token fields trainers may ask for (its TargetFields). `tensor_plane` offers trainers the
    supervision over torch.distributed (plane.py), its rendezvous on `host`:`plane_port`.
    """
    token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
    for name, value in (
        ("max-batch-tokens", max_batch_tokens),
        ("max-batch-size", max_batch_size),
        ("max-seq-len", max_seq_len),
        ("max-body-bytes", max_body_bytes),
        ("request-timeout", request_timeout),
    ):
        if value <= 0:
            raise ConfigError(
                f"--{name} must be positive, got {value}", f"pass a positive --{name}"
            )
    for name, value in (("port", port), ("plane-port", plane_port)):
        if not 0 <= value <= 65535:
            raise ConfigError(
                f"--{name} {value} is not a TCP port", "use 1..65535 (0: any free port)"
            )
    local.check_engine(target_engine)
    template = chat_templates.resolve(chat_template)
    target_dir = loading.resolve_target(assets.resolve_target_arg(str(target)))
    if not isinstance(aux_layers, list):
        aux_layers = loading.parse_aux_layers(
            aux_layers, loading.num_layers(loading.load_config(target_dir)), algorithm
        )
    local.check_reads_input_embeds(target_engine, algorithms.get(algorithm), "serve it")
    backend = local.open_backend(
        target_engine,
        target_dir,
        aux_layers,
        device,
        dtype,
        template,
        memory=target_memory,
        vllm_tensor_parallel=target_tensor_parallel,
    )
    plane = None
    try:
        if tensor_plane:
            try:
                plane = PlaneHost(
                    host,
                    plane_port,
                    timeout=request_timeout,
                    device=getattr(backend, "device", None),
                )
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen on {host}:{plane_port} for the tensor plane: "
                    f"{exc.strerror or exc}",
                    "choose another --plane-port (0: any free port), or --no-tensor-plane",
                ) from exc
        logic = TargetServer(
            backend,
            target_config=loading.load_config(target_dir).to_dict(),
            tokenizer_files=tokenizer_files(
                loading.load_tokenizer(target_dir, template), _processor_or_none(target_dir)
            ),
            token=token,
            limits=Limits(max_batch_tokens, max_batch_size, max_seq_len, max_body_bytes),
            exit_on_disconnect=exit_on_disconnect,
            fields=algorithms.get(algorithm).target_fields,
            plane=plane,
        )
        try:
            handle = HTTPHandle(logic, host, port, request_timeout)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                "choose another --port (0: any free port) or stop what holds it",
            ) from exc
        _serve_until_stopped(handle, target_dir, token, on_ready)
    finally:
        if plane is not None:
            plane.close()
        backend.close()


def _serve_until_stopped(
    handle: HTTPHandle, target_dir: Path, token: str | None, on_ready: Callable[[str], None] | None
) -> None:
    logic = handle.logic
    stop = logic.shutdown_event
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        info(
            f"serving {target_dir.name} (aux layers {logic.backend.info['aux_layers']}, "
            f"{logic.backend.info['dtype']}) {'with' if token else 'without'} a token"
        )
        if handle.host not in LOOPBACK and not token:
            info(
                "[bold yellow]warning:[/] listening beyond this machine without a token: anyone who "
                f"reaches port {handle.port} can use the target (set --token or ${TOKEN_ENV})",
                markup=True,
            )
        info(f"listening on {handle.url}")
        if logic.plane is not None:
            info(
                f"tensor plane: rendezvous on port {logic.plane.port} ({', '.join(logic.plane.backends)})"
            )
            if handle.host not in LOOPBACK:
                info(
                    "[bold yellow]warning:[/] the tensor plane's port "
                    f"{logic.plane.port} takes connections without the token (a channel's random name, "
                    "handed out over HTTP, is what a client joins with): keep that port inside the "
                    "cluster's network, or serve with --no-tensor-plane",
                    markup=True,
                )
        if on_ready is not None:
            on_ready(handle.url)
        while not stop.wait(0.2):
            pass
        info("stopping: waiting for requests in progress")
    finally:
        handle.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    info("stopped")
