"""NORM-EAGLE's code: EAGLE-3's draft, decoding and TTT loss, plus its norm term and its writer."""

from __future__ import annotations

import torch

from spec_cli.draft import decoding
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.contract import ExportFiles, Objective, TargetField, provenance
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.eagle3.ttt import ttt_forward

config = DraftConfig.from_target
build = Eagle3Draft
catch_up = decoding.catch_up
propose = decoding.propose

# the field NORM-EAGLE asks every backend for: the L2 norm of the target's final hidden state, [B, T, 1]
target_fields = {
    "hidden_norm": TargetField(
        "hidden_norm",
        width=lambda hidden: 1,
        compute=lambda final, aux, ids: final.float().norm(dim=-1, keepdim=True),
    )
}

SEEN: list[torch.Tensor] = []  # the hidden_norm values (real positions) of every batch trained on


class NormObjective(Objective):
    def __init__(self, draft: Eagle3Draft, options, activation_checkpointing: bool = False):
        super().__init__()
        self.draft, self.weight = draft, options.norm_weight
        self.kw = dict(
            ttt_steps=options.ttt_steps,
            step_weight=options.step_weight,
            loss=options.loss,
            lk_kl_scale=options.lk_kl_scale,
            lk_kl_decay=options.lk_kl_decay,
            checkpoint=activation_checkpointing,
        )

    def forward(self, batch, unit=None):
        out = ttt_forward(self.draft, batch, **self.kw)
        real = batch.attention_mask.bool()
        target = batch.extras["hidden_norm"][..., 0][real]
        SEEN.append(target.detach().cpu())
        fused = self.draft.project(batch.aux_hidden)[real].float().norm(dim=-1)
        out.loss = out.loss + self.weight * ((fused - target) ** 2).mean()
        return out


objective = NormObjective


def export(src, fmt: str, dtype: torch.dtype) -> ExportFiles:
    """`plain`: the checkpoint's tensors (embed_tokens left out: the target's is copied in) and its
    DraftConfig, as they are."""
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
        for k, v in src.state.items()
        if k != "embed_tokens.weight"
    }
    config = {
        "architectures": ["NormEagleDraft"],
        "draft_config": src.config.to_dict(),
        "spec_cli": provenance(src, fmt, dtype),
    }
    ids = list(src.config.aux_layer_ids)
    return ExportFiles(
        format=fmt,
        config=config,
        tensors=tensors,
        engine_aux_ids=ids,
        aux_layer_outputs=ids,
        num_speculative_tokens=3,
    )
