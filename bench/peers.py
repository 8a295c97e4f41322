"""The peers' own EAGLE-3 training steps, imported from their installed packages, for bench/train_step.py.

    pip install --no-deps speculators==0.9.0 specforge==0.2.0

Nothing here re-implements a peer: each `*_model` builds the peer's own draft class from a spec_cli
draft (same weights, copied by name) and each `*_step` calls the peer's own training forward on the
same batch. What the bench has to adapt, and why:

speculators 0.9.0 (`speculators.models.eagle3.core.Eagle3DraftModel.forward`, its 7-step TTT loop):
- attention: `draft_attn_impl` "sdpa" (transformers' SDPA with speculators' dense [T, (k+1)T] mask);
  "eager" is selectable. Its default, "simple_flex_attention", cannot train on CPU: torch 2.13 raises
  "FlexAttention does not support backward on CPU".
- loss: its "eager" loss implementation (`resolve_loss_config("kl_div", "eager")`); the default fused
  one is Triton (GPU only). Forward KL per step, masked mean over loss_mask, times 0.8**k, summed
  (not normalised by the weights). KL = soft-CE - H(target_p), so soft-CE_k = KL_k + H_k.
- teacher: speculators computes the teacher as verifier_lm_head(verifier_norm(last hidden state));
  the bench replaces both by nn.Identity and feeds log(target_p), so softmax(teacher) == target_p.
- draft lm_head: frozen as shipped (`_init_vocab` sets requires_grad False); `trainable_head=True`
  trains it like spec_cli does.

SpecForge 0.2.0 (`specforge.algorithms.eagle3.model.OnlineEagle3Model.forward`, the Eagle3 strategy's
`sum_k 0.8**k * ploss_k`):
- attention: backend "sdpa", its eager cache_hidden path (full [T, T + k] scores per step); its
  "flex_attention" backend has no CPU backward (as above) and "fa"/"usp" need flash-attn on CUDA.
  Its own torch.compile decorators (rope, target softmax, metrics) stay on: the first (warm-up,
  untimed) step compiles them. The reference loss below runs uncompiled (`compile=False`).
- loss: `LogSoftmaxLoss` is a Triton kernel (GPU only); the bench swaps in SpecForge's own reference
  implementation from the same module, `specforge.core.loss._compute_loss`:
  -sum(position_mask * target_p * log_softmax(logits)).mean() -- a mean over ALL B*T slots, so
  soft-CE_k (spec_cli: mean over the N_k supervised slots) = ploss_k * T / N_k.
- teacher: SpecForge takes full-vocab target logits [B, T, V]; the bench passes log(target_p) at the
  draft-vocab columns and -inf elsewhere, so its softmax over the draft vocab is target_p and
  position_mask = t2d[argmax] * loss_mask is the bench's position_mask.

Rope positions: both peers (like EAGLE's cnets.py, `position_ids + lck`) and spec_cli's `ttt_forward`
rotate step k's queries and keys at position t + k, as the serving engines do; the check compares
every step directly.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from torch import nn

PEERS = ("speculators", "specforge")
VERSIONS = {"speculators": "0.9.0", "specforge": "0.2.0"}


def missing(name: str) -> str | None:
    """None when the peer can be imported, else a one-line reason."""
    if importlib.util.find_spec(name) is None:
        return f"{name} not installed (pip install --no-deps {name}=={VERSIONS[name]})"
    try:
        _import(name)
    except Exception as e:  # noqa: BLE001 - report any import failure and go on
        return f"{name} does not import: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


def _import(name: str):
    if name == "speculators":
        import speculators.models.eagle3.core as mod
    else:
        import warnings

        with warnings.catch_warnings():  # "flash_attn is not found, falling back to flex_attention"
            warnings.simplefilter("ignore")
            import specforge.algorithms.eagle3.model as mod
    return mod


def version(name: str) -> str:
    from importlib.metadata import version as v

    return v(name)


def _llama_config(cfg, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=max(cfg.max_position_embeddings, 16384),
        hidden_act=cfg.hidden_act,
        tie_word_embeddings=False,
        **extra,
    )


def _copy(peer: nn.Module, draft, rename=lambda k: k) -> None:
    """Copy every spec_cli tensor into the peer's tensor of the same (renamed) name (a name the peer
    lacks is an error; peer-only tensors such as speculators' verifier head are left alone)."""
    src = {rename(k): v for k, v in draft.state_dict().items()}
    dst = peer.state_dict()
    missing_keys = sorted(set(src) - set(dst))
    if missing_keys:
        raise KeyError(f"peer has no tensors named {missing_keys}")
    with torch.no_grad():
        for k, v in src.items():
            dst[k].copy_(v)


# ---------------------------------------------------------------------------------------------
# speculators


def speculators_model(draft, attn_impl: str = "sdpa", trainable_head: bool = False):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    core = _import("speculators")
    cfg = draft.config
    layer = _llama_config(cfg)
    layer._attn_implementation = attn_impl
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=7)],
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    model = core.Eagle3DraftModel(config).float()
    _copy(model, draft, lambda k: k.replace("midlayer.", "layers.0."))
    model.verifier_norm = nn.Identity()  # the teacher is fed as log(target_p), see the docstring
    model.verifier_lm_head = nn.Identity()
    model.lm_head.weight.requires_grad_(trainable_head)
    return model


def speculators_inputs(batch) -> dict:
    B, T = batch.input_ids.shape
    return dict(
        hidden_states=batch.aux_hidden,
        input_ids=batch.input_ids,
        document_ids=torch.zeros(B, T, dtype=torch.long),
        loss_mask=batch.position_mask.bool(),
        verifier_last_hidden_states=batch.target_p.clamp_min(1e-30).log(),
    )


def speculators_step(model, inputs: dict, ttt_steps: int = 7, step_weight: float = 0.8):
    """(loss for backward, [K] soft-CE per step as spec_cli defines it, detached)."""
    from speculators.losses import resolve_loss_config

    _, loss, metrics = model(
        **inputs,
        ttt_steps=ttt_steps,
        ttt_step_loss_decay=step_weight,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )
    kl = torch.stack([metrics[f"loss_{k}_sum"] / step_weight**k for k in range(ttt_steps)])
    return loss, kl + _target_entropy(inputs, ttt_steps)


def _target_entropy(inputs: dict, ttt_steps: int) -> torch.Tensor:
    """[K] mean entropy of target_p over each step's supervised slots (soft-CE - KL)."""
    logp = inputs["verifier_last_hidden_states"][0]  # [T, Vd] = log target_p
    h = -(logp.exp() * logp).sum(-1)  # [T]
    mask = inputs["loss_mask"][0]
    return torch.stack([h[k:][mask[k:]].mean() for k in range(ttt_steps)]).detach()


# ---------------------------------------------------------------------------------------------
# SpecForge


class _ReferenceLoss:
    """Stands in for specforge's Triton LogSoftmaxLoss: SpecForge's own torch reference loss
    (specforge.core.loss._compute_loss, unwrapped from its torch.compile when compile is off)."""

    fn = None

    @classmethod
    def apply(cls, logits, target_p, position_mask):
        return cls.fn(logits, target_p, position_mask)


def specforge_model(draft, backend: str = "sdpa", compile: bool = False):
    import specforge.core.loss as sf_loss
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    mod = _import("specforge")
    cfg = draft.config
    config = _llama_config(
        cfg,
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=cfg.target_hidden_size,
        pretraining_tp=1,
    )
    model = LlamaForCausalLMEagle3(config, attention_backend=backend).float()
    _copy(model, draft)
    model.embed_tokens.weight.requires_grad_(False)  # frozen, as in SpecForge's trainer
    _ReferenceLoss.fn = (
        sf_loss._compute_loss
        if compile
        else getattr(sf_loss._compute_loss, "_torchdynamo_orig_callable", sf_loss._compute_loss)
    )
    mod.LogSoftmaxLoss = _ReferenceLoss
    return mod.OnlineEagle3Model(model, length=7, attention_backend=backend)


def specforge_inputs(batch, draft) -> dict:
    """SpecForge's online inputs; `target` is full-vocab logits [B, T, V] (see the docstring)."""
    B, T = batch.input_ids.shape
    target = torch.full((B, T, draft.config.vocab_size), -math.inf)
    selected = torch.nonzero(draft.t2d).squeeze(-1)
    target[..., selected] = batch.target_p.clamp_min(1e-30).log()
    return dict(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        target=target,
        loss_mask=batch.loss_mask[..., None].float(),
        hidden_states=batch.aux_hidden,
    )


def specforge_step(model, inputs: dict, ttt_steps: int = 7, step_weight: float = 0.8):
    """(loss for backward, [K] soft-CE per step as spec_cli defines it, [K] accuracy), the loss as
    SpecForge's Eagle3 strategy forms it: sum_k 0.8**k * ploss_k."""
    plosses, _, acces, *_ = model(**inputs)
    loss = sum(step_weight**k * p for k, p in enumerate(plosses))
    T = inputs["input_ids"].shape[1]
    supervised = _supervised(inputs["loss_mask"][..., 0].bool(), ttt_steps)
    ce = torch.stack([p.detach() * T / n for p, n in zip(plosses, supervised)])
    return loss, ce, torch.stack([a.detach() for a in acces])


def _supervised(mask: torch.Tensor, ttt_steps: int) -> list[float]:
    return [float(mask[:, k:].sum()) for k in range(ttt_steps)]


# ---------------------------------------------------------------------------------------------
# spec_cli's steps one by one (for the equality check only)


def spec_cli_steps(draft, batch, ttt_steps: int = 7):
    """spec_cli's own pieces (`Eagle3Draft.ttt_step`, the soft-CE head of `ttt_forward`) unrolled as
    `ttt_forward` does (step k at position t + k), each step's loss kept with its graph so that a peer's
    own weighting of the steps can be rebuilt. Returns ([K] soft-CE per step with grad, [K] top-1
    accuracy over loss_mask)."""
    from spec_cli.draft.eagle3.ttt import _head
    from spec_cli.draft.unroll import shift_left

    B, T = batch.input_ids.shape
    positions = torch.arange(T).expand(B, T)
    hidden = draft.project(batch.aux_hidden)
    caches = [[] for _ in draft.decoder_layers]
    losses, accuracy = [], []
    for k in range(ttt_steps):
        cos, sin = draft.rope(positions + k)
        hidden = draft.ttt_step(shift_left(batch.input_ids, k), hidden, cos, sin, caches)
        valid = torch.arange(T) < T - k
        b, t = (valid & shift_left(batch.position_mask, k).bool()).nonzero(as_tuple=True)
        value, hits = _head(draft, hidden, batch, b, t, k, "soft-ce", 1.0, 1.0)
        losses.append(value)
        accuracy.append(hits / (valid & shift_left(batch.loss_mask, k).bool()).sum().clamp_min(1))
    return torch.stack(losses), torch.stack(accuracy)


# ---------------------------------------------------------------------------------------------
# the equality check


def check_batch(build, T: int):
    """A draft and batch whose targets the draft gets right at about half the slots at step 0, so
    the accuracies compared are not all zero: there target_p is sharpened from the draft's own
    step-0 logits (top-1 in the draft vocab, so position_mask is unchanged)."""
    draft, batch = build(T)
    with torch.no_grad():
        logits = draft.logits(draft(batch.input_ids, batch.aux_hidden))  # [B, T, Vd]
        own = torch.rand(batch.input_ids.shape) < 0.5
        batch.target_p = torch.where(own[..., None], (logits * 50).softmax(-1), batch.target_p)
        draft_ids = batch.target_p.argmax(-1)
        batch.target_ids = draft_ids + draft.d2t[draft_ids]
    return draft, batch


def _grads(loss, named: dict) -> dict:
    g = torch.autograd.grad(loss, list(named.values()))
    return dict(zip(named, g))


def check(
    name: str,
    build,
    T: int = 64,
    ttt_steps: int = 7,
    step_weight: float = 0.8,
    speculators_attn: str = "sdpa",
) -> dict:
    """Copy one draft's weights into the peer, run both on one batch (fp32) and compare:
    ce_err:    max_k |peer soft-CE_k - spec_cli soft-CE_k|;
    acc_err:   the same for top-1 accuracy (SpecForge: correct / loss_mask slots, as spec_cli);
    grad_err:  max over parameters of max|g_peer - g_spec_cli| / max|g_spec_cli|, the peer's own
               total loss against the same combination of spec_cli's per-step losses;
    shipped_err: max_k |peer soft-CE_k - ttt_forward's|: spec_cli's training step as shipped."""
    from spec_cli.draft.eagle3.ttt import ttt_forward

    draft, batch = check_batch(build, T)
    shipped = ttt_forward(draft, batch, ttt_steps=ttt_steps, step_weight=step_weight)
    ours, ours_acc = spec_cli_steps(draft, batch, ttt_steps)
    supervised = _supervised(batch.position_mask.bool(), ttt_steps)
    ours_named = {k: p for k, p in draft.named_parameters() if p.requires_grad}
    if name == "speculators":
        model = speculators_model(draft, speculators_attn, trainable_head=True)
        loss, ce = speculators_step(model, speculators_inputs(batch), ttt_steps, step_weight)
        acc = None  # speculators reports cumulative (all earlier steps right) accuracy only
        equivalent = sum(step_weight**k * ours[k] for k in range(ttt_steps))
        rename = lambda k: k.replace("midlayer.", "layers.0.")  # noqa: E731
        peer_params = dict(model.named_parameters())
    else:
        model = specforge_model(draft)
        loss, ce, acc = specforge_step(
            model, specforge_inputs(batch, draft), ttt_steps, step_weight
        )
        T_ = batch.input_ids.shape[1]
        equivalent = sum(step_weight**k * supervised[k] / T_ * ours[k] for k in range(ttt_steps))
        rename = lambda k: k  # noqa: E731
        peer_params = dict(model.draft_model.named_parameters())
    g_peer = _grads(loss, {k: peer_params[rename(k)] for k in ours_named})
    g_ours = _grads(equivalent, ours_named)
    grad_err = max(
        float((g_peer[k] - g_ours[k]).abs().max() / g_ours[k].abs().max().clamp_min(1e-30))
        for k in ours_named
    )
    return dict(
        peer=name,
        T=T,
        loss=float(loss.detach()),
        ce=ce.tolist(),
        spec_cli_ce=ours.detach().tolist(),
        ce_err=float((ce - ours.detach()).abs().max()),
        acc_err=None if acc is None else float((acc - ours_acc).abs().max()),
        acc=ours_acc.tolist(),
        grad_err=grad_err,
        shipped_err=float((ce - shipped.step_loss).abs().max()),
    )
