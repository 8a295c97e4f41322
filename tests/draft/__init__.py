"""Shared tiny builders for the draft tests: a tiny DraftConfig, a draft with a vocab map, and a
random TargetBatch with the supervision a target would give (right padding or packing)."""

from __future__ import annotations

import pytest
import torch

from spec_cli.batch import TargetBatch
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3.model import Eagle3Draft

V, VD = 64, 24


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread avoids thread start/sync overhead (and other processes' contention).
    Test modules import this fixture, which makes it apply to them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(**overrides) -> DraftConfig:
    values = dict(
        vocab_size=V,
        target_hidden_size=12,
        aux_layer_ids=[1, 3, 4],
        target_num_layers=8,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        draft_vocab_size=VD,
    )
    values.update(overrides)
    return DraftConfig(**values)


def tiny_draft(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(tiny_config(**overrides))
    with torch.no_grad():  # non-trivial norm weights so a wrong norm shows up
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm"):
                p.uniform_(0.5, 1.5)
        draft.embed_tokens.weight.normal_()
    draft.set_vocab_map(selected_ids())
    return draft.to(dtype)


def selected_ids() -> torch.Tensor:
    return torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(7))[:VD]).values


def random_batch(
    config: DraftConfig,
    lengths: list[int],
    T: int,
    seq_lens: list[list[int]] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> TargetBatch:
    """Right-padded rows of `lengths` real tokens, or packed rows of documents `seq_lens`."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    attention_mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    position_ids = None
    packed = None
    if seq_lens is not None:
        width = max(len(s) for s in seq_lens)
        packed = torch.tensor([s + [0] * (width - len(s)) for s in seq_lens])
        position_ids = torch.zeros(B, T, dtype=torch.long)
        for b, docs in enumerate(seq_lens):
            start = 0
            for n in docs:
                position_ids[b, start : start + n] = torch.arange(n)
                start += n
    sel = selected_ids()
    logits = torch.randn(B, T, config.vocab_size, generator=gen, dtype=torch.float64) * 2
    logits[..., sel] += 1.5  # most (not all) target argmaxes fall in the draft vocab
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[sel] = True
    loss_mask = (torch.rand(B, T, generator=gen) < 0.8).long() * attention_mask
    loss_mask[torch.arange(B), torch.tensor(lengths) - 1] = 0  # nothing to shift in at the end
    target_ids = logits.argmax(-1)
    return TargetBatch(
        aux_hidden=torch.randn(B, T, 3 * config.target_hidden_size, generator=gen).to(dtype),
        input_ids=torch.randint(0, config.vocab_size, (B, T), generator=gen),
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        target_p=logits[..., sel].softmax(-1).to(dtype),
        position_mask=t2d[target_ids] & loss_mask.bool(),
        target_ids=target_ids,
        target_mass=(logits[..., sel].logsumexp(-1) - logits.logsumexp(-1)).exp().to(dtype),
        position_ids=position_ids,
        seq_lens=packed,
    )


def break_fused_kernel(monkeypatch) -> None:
    """Make the fused attention kernel 1% off in its output (what a broken kernel or a wrong call of
    it looks like) and forget earlier self-checks: the self-check must turn it down."""
    from spec_cli.draft import attention

    def off_by_one_percent(q, k, v, bias, scale):
        out, lse, state = attention.MATH.fwd(q, k, v, bias, scale)
        return out * 1.01, lse, state

    broken = attention.Kernel("broken", off_by_one_percent, attention.MATH.bwd)
    monkeypatch.setattr(attention, "fused_kernel", lambda device, dtype: broken)
    monkeypatch.setattr(attention, "_checked", {})
