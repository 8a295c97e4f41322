"""The P-EAGLE draft (arXiv 2602.01469): an EAGLE-3 draft that proposes all K tokens in one forward.

The draft is EAGLE-3's (spec_cli/draft/eagle3/model.py, the same parameter names) plus

    mask_hidden.weight   [1, 1, 3*H_t]   learned stand-in for the aux states of the unknown future
                                          (exported as `mask_hidden`, the key vLLM loads)

and `config.mask_token_id`, the token whose (frozen, target) embedding fills the same slots. At serving
time (vLLM `parallel_drafting`) one draft forward runs the verified slots and K - 1 mask slots after
them: slot n - 1 (the newest token, the target's aux states) proposes token 1, the mask slot at
position n - 1 + d proposes token d + 1, each slot attending causally, so a mask slot sees the whole
verified context and the mask slots before it.

Training lays the same thing out over whole rows (`parallel_forward`): every slot t is an anchor whose
depth-0 element is EAGLE-3's step 0, and whose depth-d element (mask token, project(mask_hidden),
position t + d) stands where the d-th mask slot stands at serving time. An element attends to the
depth-0 elements of its document up to its anchor and to the depths 1..d of its own rollout: the
TTT attention pattern (spec_cli/draft/attention.py) with the rollout's depths as the extra keys.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.draft.attention import ttt_attention
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.errors import ConfigError


class MaskHidden(nn.Module):
    """The learned mask aux state, a module of its own so that FSDP2 (which shards modules that own
    parameters and gathers them when the module is called) gathers it when it is used."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, 1, width))

    def forward(self) -> torch.Tensor:
        return self.weight


class PEagleDraft(Eagle3Draft):
    def __init__(self, config: DraftConfig):
        super().__init__(config)
        if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
            raise ConfigError(
                f"a P-EAGLE draft needs a mask token id in 0..{config.vocab_size - 1}, "
                f"got {config.mask_token_id}",
                "rebuild the draft config with --algorithm peagle",
            )
        self.mask_hidden = MaskHidden(len(config.aux_layer_ids) * config.target_hidden_size)

    def mask_state(self) -> torch.Tensor:
        """[1, 1, H]: project(mask_hidden), the state every mask slot reads (vLLM computes it once, as
        combine_hidden_states(mask_hidden))."""
        return self.project(self.mask_hidden())

    def mask_ids(self, n: int, device) -> torch.Tensor:
        return torch.full((n,), self.config.mask_token_id, dtype=torch.long, device=device)

    def parallel_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        bias,
        rollouts: list[tuple[torch.Tensor, torch.Tensor]],
    ):
        """All depths in one pass over whole rows.

        input_ids [B, T], aux_hidden [B, T, 3*H_t], position_ids [B, T]; bias: None (causal) or
        attention.Segments (packed documents); rollouts[d - 1] = (rows, anchors) [N_d] of the depth-d
        elements, nested (an element's anchor has every depth below it) and sorted by (row, anchor).
        Returns (depth-0 states [B, T, H], [states of the depth-d elements [N_d, H] for d = 1..]).
        """
        B, T = input_ids.shape
        device = input_ids.device
        counts = [rows.numel() for rows, _ in rollouts]
        n = sum(counts)
        depth_pos = (
            torch.cat(
                [
                    position_ids[rows, anchors] + d
                    for d, (rows, anchors) in enumerate(rollouts, start=1)
                ]
            )
            if n
            else position_ids.new_zeros(0)
        )
        cos0, sin0 = self.rope(position_ids)
        cosd, sind = self.rope(depth_pos[None])  # [1, N, d]
        embeds0 = self.embed_tokens(input_ids)
        embedsd = self.embed_tokens(self.mask_ids(n, device))[None]  # [1, N, H]
        h0 = self.project(aux_hidden)
        hd = self.mask_state().expand(1, n, -1)
        for i, layer in enumerate(self.decoder_layers):
            kv0 = []

            def attend0(q, k, v):
                kv0.append((k, v))
                return ttt_attention(q, k, v, bias=bias, impl=self.attn_impl)

            def attendd(q, k, v):
                return _rollout_attention(
                    q, k, v, kv0[0], rollouts, counts, (B, T), bias, self.attn_impl
                )

            new_h0, _, _ = layer(embeds0 if i == 0 else None, h0, cos0, sin0, attend0)
            if n:
                hd, _, _ = layer(embedsd if i == 0 else None, hd, cosd, sind, attendd)
            h0 = new_h0
        if self.config.norm_output:
            h0, hd = self.norm(h0), self.norm(hd)
        return h0, list(hd[0].split(counts)) if n else [
            h0.new_zeros(0, h0.shape[-1]) for _ in rollouts
        ]


def _grid(x: torch.Tensor, rows: torch.Tensor, anchors: torch.Tensor, shape) -> torch.Tensor:
    """[heads, N, d] values of N elements -> a [B, heads, T, d] grid holding them at (row, anchor)."""
    B, T = shape
    out = x.new_zeros(B, T, x.shape[0], x.shape[-1])
    return out.index_put((rows, anchors), x.transpose(0, 1)).transpose(1, 2).contiguous()


def _rollout_attention(q, k, v, kv0, rollouts, counts, shape, bias, impl):
    """The depth >= 1 elements' attention: q, k, v [1, heads, N, d] of all of them (depth blocks in
    order); kv0 the depth-0 keys and values [B, hkv, T, d]. Each depth runs as one TTT-attention call
    on a [B, T] grid (causal over the depth-0 keys up to the anchor, plus the rollout's own depths
    1..d at the anchor's slot), and its elements are read back from the grid."""
    k0, v0 = kv0
    qs, ks, vs = (x[0].split(counts, dim=1) for x in (q, k, v))
    k_grids, v_grids, out = [], [], []
    for d, (rows, anchors) in enumerate(rollouts):
        k_grids.append(_grid(ks[d], rows, anchors, shape))
        v_grids.append(_grid(vs[d], rows, anchors, shape))
        o = ttt_attention(
            _grid(qs[d], rows, anchors, shape), k0, v0, k_grids, v_grids, bias=bias, impl=impl
        )
        out.append(o.transpose(1, 2)[rows, anchors].transpose(0, 1))  # [heads, N_d, d]
    return torch.cat(out, dim=1)[None]
