"""What the target backend asks of vLLM's worker processes when the target runs tensor-parallel
(`--target-tensor-parallel N`, spec_cli/targets/vllm_backend.py): vLLM's own extension point
(`worker_extension_cls`), whose methods the engine calls on every worker by name (`collective_rpc`).

Each worker wraps its model's forward as the in-process backend does, keeping each request's aux and
final hidden states by position (after the layers' all-reduce they are the same on every rank, so rank
0 keeps them and the others keep nothing); the backend takes them once its requests are done. Tensors
travel as raw bytes with their dtype and shape (vLLM's message encoding would turn them into lists of
numbers).
"""

from __future__ import annotations

import torch

from spec_cli.engine import vllm_runner

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}


def pack(t: torch.Tensor) -> list:
    """A tensor as [bytes, dtype name, shape] (bf16 through its int16 bits: numpy has no bf16)."""
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return [raw.numpy().tobytes(), str(t.dtype).replace("torch.", ""), list(t.shape)]


def unpack(packed: list) -> torch.Tensor:
    data, dtype, shape = packed
    dtype = _DTYPES[dtype]
    raw = torch.int16 if dtype == torch.bfloat16 else dtype
    t = torch.frombuffer(bytearray(data), dtype=raw).reshape(shape)
    return t.view(dtype) if dtype == torch.bfloat16 else t


def step_positions(args, kwargs) -> torch.Tensor:
    """The positions [N] of the step's tokens, as the runner passed them to the model's forward."""
    return kwargs["positions"] if "positions" in kwargs else args[1]


def step_rows(
    runner,
    args,
    kwargs,
    hidden: torch.Tensor,
    aux: list,
    order: list[int],
    positions: torch.Tensor | None = None,
):
    """For each request of the model runner's running step: (request id, positions [n] of its tokens
    in this step, their final hidden [n, H], their aux states [n, len(order) * H] in `order`). The runner
    must follow its steps (vllm_runner.follow_steps). `positions`: the step's, already on the CPU (else
    read from the forward's arguments)."""
    positions = step_positions(args, kwargs) if positions is None else positions
    for rid, lo, hi in vllm_runner.step_requests(runner):
        yield (
            rid,
            positions[lo:hi].long().cpu(),
            hidden[lo:hi],
            torch.cat([aux[i][lo:hi] for i in order], dim=-1),
        )


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def language_model(model):
    """The module that owns embed_tokens / layers / norm (vLLM's own unwrap rule for aux layers)."""
    parent = (
        model.get_language_model()
        if hasattr(model, "get_language_model")
        else getattr(model, "language_model", model)
    )
    return getattr(parent, "model", parent)


def input_embedding(lm) -> torch.Tensor | None:
    """The language model's input embedding table [V_padded, H], found where vLLM's EAGLE proposer looks
    for the one it shares with a draft: `embed_tokens` (Llama, Qwen, Mixtral, DeepSeek ...), else
    `embedding` (gpt-oss). None when the model has neither as a plain floating-point table."""
    for name in ("embed_tokens", "embedding"):
        weight = getattr(getattr(lm, name, None), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.is_floating_point():
            return weight
    return None


def no_embedding(model) -> str:
    """The one line for a vLLM model whose input embedding input_embedding cannot find."""
    return (
        f"vLLM's {type(model).__name__} keeps its input embedding under neither `embed_tokens` nor "
        "`embedding` (where vLLM's EAGLE proposer looks for it)"
    )


class CaptureExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): methods named spec_* are called by name."""

    def spec_attach(self, layer_ids: list[int]) -> None:
        """Make the model return its aux states (vLLM's ids) and keep them per request, on TP rank 0."""
        runner = vllm_runner.worker_runner(self)
        vllm_runner.follow_steps(runner)
        model = vllm_runner.target_model(runner)
        model.set_aux_hidden_state_layers(tuple(layer_ids))
        captured = tuple(sorted(set(layer_ids)))
        order = [captured.index(i) for i in layer_ids]
        keep = _tp_rank() == 0
        self._spec_kept: dict[str, list] = {}
        forward = model.forward

        def capturing(*args, **kwargs):
            out = forward(*args, **kwargs)
            if not isinstance(out, tuple):
                return out
            hidden, aux = out
            if keep:
                for rid, pos, h, a in step_rows(runner, args, kwargs, hidden, aux, order):
                    self._spec_kept.setdefault(rid, []).append((pos, h.cpu(), a.cpu()))
            return hidden

        model.forward = capturing

    def spec_take(self, request_ids: list[str]) -> dict | None:
        """The kept (positions, hidden, aux) of these requests, packed, and forget them (rank 0; the
        other ranks answer None)."""
        if _tp_rank() != 0:
            return None
        out = {}
        for rid in request_ids:
            parts = self._spec_kept.pop(rid, [])
            if parts:
                out[rid] = [pack(torch.cat([p[i] for p in parts])) for i in range(3)]
        return out

    def spec_weights(self) -> dict:
        """This rank's rows of the language head and the input embedding (vocab-sharded, in rank order),
        its lm_head bias rows and the final norm's effective scale (the same on every rank), packed."""
        from spec_cli.targets.hf_backend import final_norm_scale

        model = vllm_runner.target_model(vllm_runner.worker_runner(self))
        lm = language_model(model)
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        if weight is None or weight.ndim != 2 or not weight.is_floating_point():
            return {
                "error": f"vLLM's {type(model).__name__} keeps no plain lm_head weight (quantized?)"
            }
        bias = getattr(head, "bias", None)
        scale = final_norm_scale(getattr(lm, "norm", None), int(weight.shape[1]))
        embed = input_embedding(lm)
        if embed is None:
            return {"error": no_embedding(model)}
        return {
            "lm_head": pack(weight),
            "embed": pack(embed),
            "bias": pack(bias) if isinstance(bias, torch.Tensor) else None,
            "norm_scale": pack(scale) if scale is not None else None,
        }
