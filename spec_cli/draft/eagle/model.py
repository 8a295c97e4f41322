"""The EAGLE-1/2 draft (Li et al. 2024): it regresses the target's next feature, the last hidden state
after the target's final norm, from cat(embed(x[t+1]), f[t]); tokens come from the target's own frozen
lm_head over the whole vocabulary, with no norm in between (vLLM llama_eagle.py, SGLang
llama_eagle.py and the original cnets1.py agree; checked against vLLM 0.32: docs/results.md).

Parameter names are the ones both engines load (file keys without their `model.` prefix):

    embed_tokens.weight            [V, H]      the target's, frozen (the engines share it; not exported)
    fc.weight                      [H, 2H]     no bias (vLLM has none; SGLang's is written as zeros)
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
    layers.{i}.post_attention_layernorm.weight
    layers.{i}.input_layernorm.weight          i >= 1 only: layer 0 reads fc's output as it is
    lm_head.weight                 [V, H]      the target's, frozen (the engines share it; not exported)

One step maps (token ids, incoming feature) -> the predicted next feature, which is fed to the next
step as it is and whose lm_head logits propose the next token. H is the target's hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.layers import MLP, Attention, RMSNorm, feature_noise, rope_inv_freq
from spec_cli.draft.stepping import SteppedDraft
from spec_cli.errors import ConfigError


class EagleLayer(nn.Module):
    """A Llama decoder layer; the first has no input norm (it reads fc's output as it is)."""

    def __init__(self, config: DraftConfig, first: bool):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        if not first:
            self.input_layernorm = RMSNorm(H, eps)
        self.first = first
        self.self_attn = Attention(config, H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, attend):
        """hidden [B, T, H] -> (hidden, k, v); attend(q, k, v) -> [B, h, T, d]."""
        x = hidden if self.first else self.input_layernorm(hidden)
        q, k, v = self.self_attn.qkv(x, cos, sin)
        hidden = hidden + self.self_attn.out(attend(q, k, v))
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, k, v


class EagleDraft(SteppedDraft):
    title = "EAGLE-1/2"  # (errors name the algorithm: MSD's draft is this one)

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.hidden_size != config.target_hidden_size:
            raise ConfigError(
                f"an {self.title} draft predicts the target's {config.target_hidden_size}-wide "
                f"feature; its hidden size {config.hidden_size} must be the same",
                "drop --draft-hidden-size",
            )
        if config.draft_vocab_size != config.vocab_size:
            raise ConfigError(
                f"an {self.title} draft proposes from the target's whole vocabulary "
                f"({config.vocab_size} tokens, through the target's lm_head); the vocab map "
                f"has {config.draft_vocab_size}",
                f"build one with `spec build-vocab-map --draft-vocab-size {config.vocab_size}`",
            )
        if config.fc_norm or config.norm_output:
            raise ConfigError(
                "--fc-norm and --norm-output are EAGLE-3.1 options",
                "drop them for --algorithm eagle",
            )
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(
            EagleLayer(config, first=i == 0) for i in range(config.num_hidden_layers)
        )
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's
        rope_inv_freq(config)  # fail early on an unsupported rope type

    # -- weights from the target -----------------------------------------------------------------

    @torch.no_grad()
    def copy_embeddings(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H]."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ConfigError(
                f"target embedding {tuple(weight.shape)} does not fit the draft's "
                f"{tuple(self.embed_tokens.weight.shape)}",
                "train the draft for this target",
            )
        self.embed_tokens.weight.copy_(weight)

    @torch.no_grad()
    def copy_head(self, weight: torch.Tensor) -> None:
        """Copy the target's lm_head [V, H] (the draft proposes through it; it is never trained)."""
        if tuple(weight.shape) != tuple(self.lm_head.weight.shape):
            raise ConfigError(
                f"target lm_head {tuple(weight.shape)} does not fit the draft's "
                f"{tuple(self.lm_head.weight.shape)}",
                "train the draft for this target",
            )
        self.lm_head.weight.copy_(weight)

    def set_vocab_map(self, selected_token_ids: torch.Tensor) -> None:
        """The whole vocabulary, in order: an EAGLE-1/2 draft has no id map of its own."""
        ids = torch.as_tensor(selected_token_ids).long().cpu()
        if not torch.equal(ids, torch.arange(self.config.vocab_size)):
            raise ConfigError(
                f"an {self.title} draft proposes from the target's whole vocabulary; this vocab "
                "map selects a subset",
                f"build one with `spec build-vocab-map "
                f"--draft-vocab-size {self.config.vocab_size}`",
            )

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the draft's vocabulary is the target's

    @property
    def decoder_layers(self) -> list[EagleLayer]:
        return list(self.layers)

    # -- pieces ----------------------------------------------------------------------------------

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [B, T, H] are the draft's state as they are (with --hidden-noise,
        a noisy copy in training: the feature loss's targets stay clean)."""
        features = features.to(self.fc.weight.dtype)
        if self.training and self.hidden_noise > 0:
            features = feature_noise(features, self.hidden_noise, offset=self.noise_offset)
        return features

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """[..., H] predicted feature -> [..., V] through the target's lm_head (no norm, as served)."""
        return self.lm_head(state)

    def _layers(self, input_ids, hidden, cos, sin, attends):
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden], dim=-1))  # [B, T, H]
        kvs = []
        for layer, attend in zip(self.layers, attends):
            x, k, v = layer(x, cos, sin, attend)
            kvs.append((k, v))
        return x, kvs
