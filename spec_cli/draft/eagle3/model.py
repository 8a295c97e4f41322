"""The EAGLE-3 draft: a Llama-style decoder layer over [token embedding, target aux hidden states].

Parameter and buffer names are the ones the serving engines load (docs/eagle.md "The EAGLE-3 draft's
parameters"), so export is a rename at most:

    embed_tokens.weight            [V, H]      copied from the target, frozen
    fc_norm.{0,1,2}.weight         [H_t]       EAGLE-3.1 only: one RMSNorm per aux chunk
    fc.weight                      [H, 3*H_t]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    midlayer.self_attn.{q,k,v,o}_proj.weight   q/k/v read 2*H:
                                   cat(input_layernorm(embeds), hidden_norm(hidden))
    midlayer.mlp.{gate,up,down}_proj.weight
    layers.{i}.*                   i = 1..n-1: ordinary Llama layers (H input), when num_hidden_layers > 1.
                                   vLLM names the first layer `layers.0.` (it maps `midlayer.` there), so
                                   the extra layers continue that numbering.
    norm.weight, lm_head.weight    [Vd, H]
    d2t [Vd] int64 (target_id = draft_id + d2t[draft_id]), t2d [V] bool  (persistent buffers)

One step maps (token ids, incoming state) -> the state fed to the next step:
    x = layer_0(embed(ids), hidden); x = layer_i(x) ...; state = norm(x) if norm_output else x
and `logits(state)` applies `norm` unless `norm_output` already did.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_cli.artifacts import vocab_map
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.layers import MLP, Attention, RMSNorm, feature_noise, rope_inv_freq
from spec_cli.draft.stepping import SteppedDraft
from spec_cli.errors import ConfigError


class DecoderLayer(nn.Module):
    """Llama decoder layer. The first one (`midlayer`) also reads the token embeddings: its q/k/v
    take cat(input_layernorm(embeds), hidden_norm(hidden)) [2*H]; the residual is the un-normed hidden."""

    def __init__(self, config: DraftConfig, first: bool):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.first = first
        self.input_layernorm = RMSNorm(H, eps)
        if first:
            self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(config, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, cos, sin, attend):
        """embeds [B, T, H] (first layer; None otherwise), hidden [B, T, H] ->
        (hidden [B, T, H], k [B, hkv, T, d], v [B, hkv, T, d]). attend(q, k, v) -> [B, h, T, d]."""
        if self.first:
            x = torch.cat(
                [self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1
            )  # [B, T, 2H]
        else:
            x = self.input_layernorm(hidden)
        q, k, v = self.self_attn.qkv(x, cos, sin)
        hidden = hidden + self.self_attn.out(attend(q, k, v))
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, k, v


# ---------------------------------------------------------------------------------------------
# the draft


class Eagle3Draft(SteppedDraft):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        H, Ht = config.hidden_size, config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(Ht, config.rms_norm_eps) for _ in config.aux_layer_ids
            )
        self.fc = nn.Linear(len(config.aux_layer_ids) * Ht, H, bias=False)  # EAGLE-3: 3 aux states
        self.midlayer = DecoderLayer(config, first=True)
        if config.num_hidden_layers > 1:
            self.layers = nn.ModuleDict(
                {
                    str(i): DecoderLayer(config, first=False)
                    for i in range(1, config.num_hidden_layers)
                }
            )
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        rope_inv_freq(config)  # fail early on an unsupported rope type

    # -- vocabulary and weights ------------------------------------------------------------------

    @torch.no_grad()
    def set_vocab_map(self, selected_token_ids: torch.Tensor) -> None:
        """Fill d2t (offsets) and t2d (mask) from the ascending selected target ids [Vd]."""
        ids = torch.as_tensor(selected_token_ids).long().to(self.d2t.device)
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        if ids.shape != (Vd,):
            raise ConfigError(
                f"vocab map has {ids.numel()} ids, the draft vocab is {Vd}",
                "rebuild the vocab map or the draft with the same --draft-vocab-size",
            )
        if not vocab_map.valid_ids(ids, V):
            raise ConfigError(
                "selected token ids must be ascending, distinct and inside the target "
                f"vocab (0..{V - 1})",
                "rebuild the vocab map for this target",
            )
        self.d2t.copy_(vocab_map.d2t_from_ids(ids))
        self.t2d.copy_(vocab_map.t2d_from_ids(ids, V))

    @property
    def has_vocab_map(self) -> bool:
        return int(self.t2d.sum()) == self.config.draft_vocab_size

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (d2t holds offsets)."""
        return vocab_map.to_target_ids(draft_ids, self.d2t)

    @torch.no_grad()
    def copy_embeddings(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H]."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ConfigError(
                f"target embedding {tuple(weight.shape)} does not fit the draft's "
                f"{tuple(self.embed_tokens.weight.shape)}",
                "the draft's hidden size must equal the target's",
            )
        self.embed_tokens.weight.copy_(weight)

    @torch.no_grad()
    def init_from_target(
        self, lm_head_selected: torch.Tensor, final_norm: torch.Tensor | None = None
    ) -> bool:
        """Start `lm_head` from the target's lm_head rows of the draft vocab and `norm` from the target's
        final norm, so the draft learns to produce a state in the target's own output space instead of
        also learning a token geometry from scratch. (The draft at position t reads the target's state
        at t and the token t+1 and predicts token t+2, so no other layer can be copied as is.)
        False (nothing changed) when the shapes do not allow it."""
        if tuple(lm_head_selected.shape) != tuple(self.lm_head.weight.shape):
            return False
        self.lm_head.weight.copy_(lm_head_selected)
        if final_norm is not None and tuple(final_norm.shape) == tuple(self.norm.weight.shape):
            self.norm.weight.copy_(final_norm)
        return True

    @torch.no_grad()
    def init_layer_from_target(self, layer: dict[str, torch.Tensor], aux_index: int) -> None:
        """Start the first decoder layer from a target decoder layer (`layer`: {part: tensor}, the parts
        of loading.LAYER_PARTS) and `fc` as a pass-through of aux state `aux_index`: at the start the
        draft is that target layer applied to the aux state (its residual stream). q/k/v read
        cat(embeds, hidden): their hidden half is the target's projection, their embedding half keeps its
        random start (the token is new to the layer); hidden_norm is the target's input norm. fc's columns
        for the other aux states start at zero (they learn from there). One error when the shapes differ."""
        first, H = self.midlayer, self.config.hidden_size
        attn = first.self_attn
        pairs = {
            "self_attn.o_proj.weight": attn.o_proj.weight,
            "mlp.gate_proj.weight": first.mlp.gate_proj.weight,
            "mlp.up_proj.weight": first.mlp.up_proj.weight,
            "mlp.down_proj.weight": first.mlp.down_proj.weight,
            "input_layernorm.weight": first.hidden_norm.weight,
            "post_attention_layernorm.weight": first.post_attention_layernorm.weight,
        }
        pairs.update(
            {f"self_attn.{n}_proj.weight": getattr(attn, f"{n}_proj").weight[:, H:] for n in "qkv"}
        )
        wrong = [
            f"{name} {tuple(layer[name].shape)} against {tuple(param.shape)}"
            for name, param in pairs.items()
            if tuple(layer[name].shape) != tuple(param.shape)
        ]
        if wrong or self.config.target_hidden_size != H:
            raise ConfigError(
                "the target's layer does not fit the draft's ("
                + "; ".join(
                    wrong
                    or [f"target hidden {self.config.target_hidden_size} against the draft's {H}"]
                )
                + ")",
                "leave the draft's shape at the target's (no --draft-hidden-size, "
                "--draft-intermediate-size, --draft-heads or --draft-kv-heads), or leave out "
                "--init-layer-from-target",
            )
        for name, param in pairs.items():
            param.copy_(layer[name].to(param.dtype))
        self.fc.weight.zero_()
        self.fc.weight[:, aux_index * H : (aux_index + 1) * H].copy_(
            torch.eye(H, dtype=self.fc.weight.dtype)
        )

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        extra = [self.layers[str(i)] for i in range(1, self.config.num_hidden_layers)]
        return [self.midlayer, *extra]

    # -- pieces ----------------------------------------------------------------------------------

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3*H_t] target aux states -> [B, T, H]: (noise) fc_norm (EAGLE-3.1) then fc."""
        aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        if self.training and self.hidden_noise > 0:  # --hidden-noise: training only
            aux_hidden = feature_noise(
                aux_hidden,
                self.hidden_noise,
                len(self.config.aux_layer_ids),
                offset=self.noise_offset,
            )
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.config.aux_layer_ids), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] step state -> [..., Vd]; `norm` unless norm_output already applied it."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def _layers(self, input_ids, hidden, cos, sin, attends):
        """Run the decoder stack. attends[i](q, k, v) -> [B, h, T, d] is layer i's attention.
        Returns (state fed to the next step [B, T, H], [(k, v)] per layer)."""
        embeds = self.embed_tokens(input_ids)  # [B, T, H], frozen
        kvs = []
        for i, layer in enumerate(self.decoder_layers):
            hidden, k, v = layer(embeds if i == 0 else None, hidden, cos, sin, attends[i])
            kvs.append((k, v))
        return (self.norm(hidden) if self.config.norm_output else hidden), kvs
