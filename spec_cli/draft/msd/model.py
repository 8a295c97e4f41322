"""The MSD draft: EAGLE-1/2's layers (spec_cli/draft/eagle/model.py) without a token embedding table.

Each slot reads cat(e[t + 1], f[t]) through fc, where f is the target's last hidden state (after its final
norm) and e is what the target's first decoder layer reads at that token: the token's embedding as the
target computes it (Gemma scales it), and at an image placeholder the image's projected features. In
training e comes from the target with the supervision (TargetBatch.extras["input_embeds"]); in decoding,
for the prompt from the target's prefill and for drafted tokens from the target's own input embedding
module (`use_target_embeddings`), which the draft never stores or trains.

Parameter names as EAGLE-1/2's, less embed_tokens: fc.weight [H, 2H], layers.{i}..., lm_head.weight [V, H]
(the target's, frozen).
"""

from __future__ import annotations

import torch

from spec_cli.draft.eagle.model import EagleDraft
from spec_cli.errors import ConfigError


class MsdDraft(EagleDraft):
    title = "MSD"

    def __init__(self, config):
        super().__init__(config)
        del self.embed_tokens  # it reads the target's input embeddings, image features included

    def copy_embeddings(self, weight: torch.Tensor) -> None:
        raise ConfigError(
            "an MSD draft holds no token embeddings: it reads what the target's first layer "
            "reads (images included)",
            "pass the target's embedding module with use_target_embeddings (spec eval does)",
        )

    def use_target_embeddings(self, module) -> None:
        """Decode with the target's input embedding module (kept outside the draft's own modules: never
        moved, stored or trained with it)."""
        self.__dict__["_target_embed"] = module

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        module = self.__dict__.get("_target_embed")
        if module is None:
            raise ConfigError(
                "an MSD draft embeds the tokens it drafts with the target's embedding module, and "
                "none was given",
                "call use_target_embeddings(target.get_input_embeddings())",
            )
        return module(ids.to(module.weight.device))

    def _layers(self, inputs, hidden, cos, sin, attends):
        """inputs: the target's input embeddings [B, T, H_t] of the tokens the slots read, or token ids [B, T]
        (drafted tokens: embedded by the target's module)."""
        embeds = inputs if inputs.is_floating_point() else self.embed(inputs)
        x = self.fc(torch.cat([embeds.to(hidden.dtype), hidden], dim=-1))  # [B, T, H]
        kvs = []
        for layer, attend in zip(self.layers, attends):
            x, k, v = layer(x, cos, sin, attend)
            kvs.append((k, v))
        return x, kvs
