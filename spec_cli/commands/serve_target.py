"""`spec serve-target`: a target model answering `spec train --remote` (spec_cli.serve)."""

from __future__ import annotations

from typing import Annotated

import typer

from spec_cli.commands.options import (
    AuxLayers,
    Config,
    Device,
    DraftAlgorithm,
    Dtype,
    Quiet,
    Target,
    TargetEngine,
    TargetMemory,
    TargetTensorParallel,
)
from spec_cli.console import set_quiet
from spec_cli.help import LIMITS, SERVER


def serve_target_cmd(
    target: Target,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to listen on. 127.0.0.1: this machine only; 0.0.0.0: every "
            "interface (set --token).",
            rich_help_panel=SERVER,
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            "--port",
            "-p",
            help="TCP port (0: any free port; the URL is printed).",
            min=0,
            max=65535,
            rich_help_panel=SERVER,
        ),
    ] = 8000,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="SPEC_SERVE_TOKEN",
            help="Require `Authorization: Bearer TOKEN` on every "
            "request. Default: $SPEC_SERVE_TOKEN; unset: no check.",
            rich_help_panel=SERVER,
        ),
    ] = None,
    aux_layers: AuxLayers = None,
    algorithm: DraftAlgorithm = "eagle3",
    device: Device = None,
    dtype: Dtype = None,
    target_engine: TargetEngine = "transformers",
    target_memory: TargetMemory = None,
    target_tensor_parallel: TargetTensorParallel = 1,
    max_batch_tokens: Annotated[
        int,
        typer.Option(
            "--max-batch-tokens",
            help="Refuse a generate request of more than this many tokens (B x T).",
            rich_help_panel=LIMITS,
        ),
    ] = 65536,
    max_batch_size: Annotated[
        int,
        typer.Option(
            "--max-batch-size",
            help="Refuse a generate request of more than this many rows.",
            rich_help_panel=LIMITS,
        ),
    ] = 1024,
    max_seq_len: Annotated[
        int,
        typer.Option(
            "--max-seq-len",
            help="Refuse rows longer than this (also capped at the target's "
            "max_position_embeddings).",
            rich_help_panel=LIMITS,
        ),
    ] = 32768,
    max_body_bytes: Annotated[
        int,
        typer.Option(
            "--max-body-bytes",
            help="Refuse request bodies larger than this.",
            rich_help_panel=LIMITS,
        ),
    ] = 64 << 20,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout",
            help="Seconds a client may take to send a request, or keep an idle connection.",
            rich_help_panel=SERVER,
        ),
    ] = 120.0,
    exit_on_disconnect: Annotated[
        bool,
        typer.Option(
            "--exit-on-disconnect",
            help="Stop when the last trainer that connected disconnects.",
            rich_help_panel=SERVER,
        ),
    ] = False,
    plane_port: Annotated[
        int,
        typer.Option(
            "--plane-port",
            help="TCP port of the tensor plane's rendezvous (0: any free port; trainers learn it "
            "from /v1/info). Supervision tensors go over torch.distributed send/recv "
            "(NCCL between GPU hosts, gloo otherwise) when a trainer can join.",
            min=0,
            max=65535,
            rich_help_panel=SERVER,
        ),
    ] = 0,
    tensor_plane: Annotated[
        bool,
        typer.Option(
            "--tensor-plane/--no-tensor-plane",
            help="Offer the tensor plane; without it every answer travels in the HTTP body.",
            rich_help_panel=SERVER,
        ),
    ] = True,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            help="The chat template the trainers' data is rendered with (a Jinja file or "
            "chatml, llama3, gemma, mistral): sent with the tokenizer, and part of the "
            "tokenizer fingerprint the server reports. Default: the target's own.",
            rich_help_panel=SERVER,
        ),
    ] = None,
    config: Config = None,
    quiet: Quiet = False,
):
    """Serve a target model: answer supervision requests from `spec train --remote`."""
    from spec_cli.serve.run import serve

    set_quiet(quiet)
    serve(
        target,
        host=host,
        port=port,
        token=token,
        aux_layers=aux_layers,
        device=device,
        dtype=dtype,
        max_batch_tokens=max_batch_tokens,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_body_bytes=max_body_bytes,
        request_timeout=request_timeout,
        exit_on_disconnect=exit_on_disconnect,
        target_engine=target_engine,
        chat_template=chat_template,
        target_memory=target_memory,
        target_tensor_parallel=target_tensor_parallel,
        algorithm=algorithm,
        tensor_plane=tensor_plane,
        plane_port=plane_port,
    )
