"""The training step of `spec train`, run on fake tensors for a target's real shapes: its peak memory
and FLOPs per GPU without a GPU (spec_cli/plan/memory.py says what is counted).

The step is the trainer's own (spec_cli/draft/step.py: make_optimizer, forward_backward,
optimizer_step) on the algorithm's own draft and objective. It emulates a CUDA rank on fake CPU
tensors: torch's autograd needs a device guard for the device it records, which a CPU-only build has
for the CPU alone. The dtypes are the CUDA run's: bf16 autocast (matmuls and linears in bf16), and the
draft upcasts its softmaxes and norms itself, so the two autocast policies give the same dtypes for
every op the step runs. The attention runs the CPU's fused kernel, whose outputs (out, lse) are the
CUDA kernel's sizes. Every slot of the batch carries a loss (the upper bound; real data masks some).

The measured step is a real run's second: the optimizer's own step, on gradients shaped as the
parameters', first makes its state (AdamW's moments), which is then resident, as in every step of a
real run after the first. The measured step's forward and backward also count its FLOPs, by torch's
formulas (FlopCounterMode's; its module tracking keeps references the memory would count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from spec_cli.batch import TargetBatch
from spec_cli.draft.algorithm import FINAL_HIDDEN, LM_HEAD, Algorithm  # noqa: F401
from spec_cli.draft.optim import ordered
from spec_cli.draft.step import forward_backward, make_optimizer, optimizer_step
from spec_cli.errors import ConfigError
from spec_cli.plan import plannable  # noqa: F401 (where the plan's callers have it from)
from spec_cli.plan.memory import LiveBytes, fake_weights
from spec_cli.train_options import OptimOptions


@dataclass(frozen=True)
class StepMeasure:
    """One rank's training step at [batch, seq_len] tokens."""

    resident: int  # bytes alive when the step starts: weights, optimizer state, the batch
    peak: int  # bytes at the step's peak (resident included)
    flops: (
        int  # forward + backward FLOPs (matmuls and attention, as torch's FlopCounterMode counts)
    )
    trained: int  # trained parameters
    frozen: int  # frozen parameters (the target's embedding, EAGLE-1/2's lm_head)
    batch_bytes: int  # the supervision batch alone (part of resident)


def _attention_flops(q_shape, k_shape, causal: bool) -> int:  # (FlopCounterMode passes shapes)
    """Forward FLOPs of attention: 2 matmuls of B*h*Tq*Tk*d multiply-adds; causal does half of them."""
    B, h, Tq, d = q_shape
    Tk = k_shape[2]
    return 4 * B * h * Tq * Tk * d // (2 if causal else 1)


def _flash_cpu_fwd(
    query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs
) -> int:
    return _attention_flops(query, key, is_causal)


def _flash_cpu_bwd(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    dropout_p=0.0,
    is_causal=False,
    *args,
    out_shape=None,
    **kwargs,
) -> int:
    # recompute S, then dV, dP, dQ, dK: 5 matmuls to the forward's 2
    return 5 * _attention_flops(query, key, is_causal) // 2


# the CPU fused kernel the planned step runs has no formula in FlopCounterMode (CUDA's kernels do)
ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_fwd,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_bwd,
}


class FlopCount(TorchDispatchMode):
    """FLOPs of the ops run under it (matmuls and attention, as torch's FlopCounterMode counts them,
    with ATTENTION_FLOPS), holding no tensor."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self._formulas = {
            **flop_registry,
            **{k: shape_wrapper(f) for k, f in ATTENTION_FLOPS.items()},
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def plan_batch(
    algorithm: Algorithm,
    config,
    batch: int,
    seq_len: int,
    device: torch.device,
    target_dtype: torch.dtype,
    slots: int | None = None,
) -> TargetBatch:
    """Empty tensors shaped as a backend hands the trainer (spec_cli/batch.py's contract); slots: as a
    feature cache hands one context-parallel rank its rows' slots (that many of them)."""

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=device)

    B, T, H = batch, seq_len, config.target_hidden_size
    n = T if slots is None else slots
    long = torch.long
    return TargetBatch(
        aux_hidden=empty(B, n, len(config.aux_layer_ids) * H, dtype=target_dtype),
        input_ids=empty(B, n, dtype=long),
        attention_mask=empty(B, T, dtype=long),
        loss_mask=empty(B, n, dtype=long),
        target_p=empty(B, n, config.draft_vocab_size),
        position_mask=empty(B, n, dtype=torch.bool),
        target_ids=empty(B, n, dtype=long),
        target_mass=empty(B, n),
        final_hidden=empty(B, n, H, dtype=target_dtype)
        if FINAL_HIDDEN in algorithm.needs
        else None,
        slots=None if slots is None else empty(n, dtype=long),
    )


def measure_step(
    algorithm: Algorithm,
    config,
    options,
    seq_len: int,
    batch: int = 1,
    activation_checkpointing: bool = False,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    target_dtype: torch.dtype = torch.bfloat16,
    grad_clip: float = 1.0,
    optim=None,
    context: int = 1,
) -> StepMeasure:
    """Run `algorithm`'s training step for a draft of `config` (a DraftConfig) on fake tensors.
    options: the objective's (ObjectiveOptions); autocast_dtype None runs fp32 (a CPU run); context:
    --context-parallel's N, one rank of whose group is measured (its collectives done locally, with the
    same shapes: spec_cli/draft/context.py LocalShard)."""

    reason = plannable(algorithm)
    if reason:
        raise ConfigError(
            f"no plan for --algorithm {algorithm.name}: {reason}",
            "plan the same target with --algorithm eagle3 for a bound",
        )
    optim = optim or OptimOptions()
    device = torch.device("cpu")
    with torch.device("meta"):
        draft = algorithm.build(config)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_weights(draft, device)
        draft.attn_impl = "fused"  # what "auto" picks once the kernel passes its self-check
        objective = algorithm.objective(
            draft, options, activation_checkpointing=activation_checkpointing
        )
        slots = None
        if context > 1:
            if not algorithm.context_parallel:
                raise ConfigError(
                    f"--context-parallel: {algorithm.title} does not split its rows over ranks",
                    "plan it without --context-parallel, or plan --algorithm eagle3",
                )
            from spec_cli.draft.context import Context, kept_ranges, padded_length

            objective.context = Context(context, 0, alone=True)
            seq_len = padded_length(
                seq_len, context
            )  # the rank's slots, as a feature cache reads them
            slots = sum(b - a for a, b in kept_ranges(context, 0, seq_len, objective.context_halo))
        data = plan_batch(algorithm, config, batch, seq_len, device, target_dtype, slots)
        named = ordered([(n, p) for n, p in draft.named_parameters() if p.requires_grad], optim)
        params = [p for _, p in named]
        optimizer = make_optimizer(params, optim, [n for n, _ in named])
        autocast = (
            torch.autocast("cpu", dtype=autocast_dtype)
            if autocast_dtype is not None
            else torch.autocast("cpu", enabled=False)
        )
        memory = LiveBytes()
        memory.track(list(draft.parameters()), list(draft.buffers()), data.tensors())
        flops = FlopCount()
        with memory:
            # the optimizer's state, made by its own step (the gradients are freed by it)
            for p in params:
                p.grad = torch.empty_like(p)
            optimizer_step(params, optimizer, grad_clip)
            resident = memory.now
            memory.reset_peak()
            with flops:
                forward_backward(objective, objective, data, 1, autocast)
            optimizer_step(params, optimizer, grad_clip)
        return StepMeasure(
            resident=resident,
            peak=memory.peak,
            flops=int(flops.total),
            trained=sum(p.numel() for p in params),
            frozen=sum(p.numel() for p in draft.parameters() if not p.requires_grad),
            batch_bytes=sum(t.numel() * t.element_size() for t in data.tensors().values()),
        )
