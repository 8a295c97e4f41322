"""The DFlash draft, as vLLM 0.32 builds it (model_executor/models/qwen3_dflash.py DFlashQwen3Model).

Parameters (the names vLLM loads, after its `model.` prefix):

    embed_tokens.weight            [V, H]      copied from the target, frozen (not exported: vLLM shares it)
    fc.weight                      [H, n*H_t]  the concatenated aux states -> the context state
    hidden_norm.weight             [H]         RMSNorm of the context state
    layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, .q_norm.weight, .k_norm.weight [head_dim] (Qwen3 attention)
    layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight    [Vd, H]
    d2t [Vd] int64 offsets, t2d [V] bool       (persistent buffers, as the EAGLE-3 draft's)

Context. The target's aux states at a position p give c = hidden_norm(fc(aux)); every layer i turns c
into keys and values with its own projections: k = k_norm(k_proj(c)) with rope at p, v = v_proj(c). The
context never runs through a layer's norm, attention or MLP (vLLM precompute_and_store_context_kv).

Block. The queries are [the newest verified token, mask x (b - 1)] at positions p + 1 .. p + b (p: the
last context position); they run the layers as a Qwen3 decoder (pre-norm, q_norm/k_norm, SiLU MLP) and
each attends to all the context keys up to p and to every query of its block (no causal mask), then the
final norm and lm_head: the output at block offset j >= 1 proposes the token at position p + 1 + j.

Training lays the blocks out over whole rows (`block_forward`): slot t of a row anchors the block whose
first token is x[t + 1] (the batch's shifted input_ids[t]) at position t + 1, with context t' <= t; block
offset j there stands where vLLM's j-th mask stands and proposes x[t + 1 + j] (the shifted batch's
target at row t + j - 1: spec_cli/draft/dflash/objective.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from spec_cli.draft.attention import ttt_attention
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.layers import MLP, KVCache, RMSNorm, apply_rope, rope_inv_freq
from spec_cli.draft.stepping import SteppedDraft
from spec_cli.errors import ConfigError


class QKNormAttention(nn.Module):
    """Qwen3 attention projections: q/k/v/o without bias, RMSNorm over each head of q and k before rope."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        h, kv, d, H = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, kv * d, bias=False)
        self.v_proj = nn.Linear(H, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> k, v [B, hkv, T, d] (k normed per head, rope applied)."""
        B, T, _ = x.shape
        k = self.k_proj(x)
        # the norm's fp32 weight would promote a bf16 (autocast) projection to fp32 beside a bf16 v
        k = self.k_norm(k.view(B, T, self.kv_heads, self.head_dim)).to(k.dtype).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> q [B, h, T, d], k, v [B, hkv, T, d]."""
        B, T, _ = x.shape
        q = self.q_proj(x)
        q = self.q_norm(q.view(B, T, self.heads, self.head_dim)).to(q.dtype).transpose(1, 2)
        k, v = self.kv(x, cos, sin)
        return apply_rope(q, cos, sin), k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, h, T, d] -> [B, T, H]."""
        return self.o_proj(o.transpose(1, 2).flatten(2))


class BlockLayer(nn.Module):
    """A Qwen3 decoder layer whose queries also see keys and values from the context."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = QKNormAttention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, attend):
        """hidden [B, T, H] -> [B, T, H]; attend(q, k, v) -> [B, h, T, d] (the block's own k, v)."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + self.self_attn.out(attend(q, k, v))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraft(Eagle3Draft):
    """The vocabulary, embedding and head handling are EAGLE-3's (set_vocab_map, to_target_ids,
    copy_embeddings, init_from_target, project, logits); the layers are DFlash's own."""

    def __init__(self, config: DraftConfig):
        SteppedDraft.__init__(self)
        if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
            raise ConfigError(
                f"a DFlash draft needs a mask token id in 0..{config.vocab_size - 1}, "
                f"got {config.mask_token_id}",
                "rebuild the draft config with --algorithm dflash",
            )
        if config.fc_norm or config.norm_output:
            raise ConfigError(
                "a DFlash draft has no --fc-norm or --norm-output (vLLM's dflash model has neither)",
                "train it without those options",
            )
        if block_size(config) < 2:
            raise ConfigError(
                f"a DFlash block holds at least 2 tokens, the config says {block_size(config)}",
                "train with --block-size 2 or more",
            )
        self.config = config
        H, Ht = config.hidden_size, config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        self.fc = nn.Linear(len(config.aux_layer_ids) * Ht, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        rope_inv_freq(config)  # fail early on an unsupported rope type

    @property
    def decoder_layers(self) -> list[BlockLayer]:
        return list(self.layers)

    @property
    def block_size(self) -> int:
        return block_size(self.config)

    def mask_ids(self, shape, device) -> torch.Tensor:
        return torch.full(shape, self.config.mask_token_id, dtype=torch.long, device=device)

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, n*H_t] aux states -> the context state hidden_norm(fc(aux)) [B, T, H] (noise in training)."""
        return self.hidden_norm(self.project(aux_hidden))

    # -- training: every slot anchors a block ----------------------------------------------------

    def block_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        bias=None,
        size: int | None = None,
        checkpoint: bool = False,
        first: int = 1,
    ) -> list[torch.Tensor]:
        """The blocks anchored at every slot of whole rows (module docstring).

        input_ids [B, T] shifted (x[t + 1] at t), aux_hidden [B, T, n*H_t], position_ids [B, T]; bias: None
        (causal over the context) or attention.Segments (packed documents). Returns the final states of
        block offsets first .. size - 1, each [B, T, H] (DFlash: offset j at slot t proposes x[t + 1 + j];
        DSpark samples from the anchor too, first=0). The slot t's block sees the context t' <= t of its
        own document and the whole block; nothing else."""
        size = size or self.block_size
        B, T = input_ids.shape
        context = self.context(aux_hidden)  # [B, T, H]
        cos_c, sin_c = self.rope(position_ids)
        ids = torch.cat(
            [input_ids[None], self.mask_ids((size - 1, B, T), input_ids.device)]
        )  # [b, B, T]
        offsets = torch.arange(1, size + 1, device=input_ids.device)[:, None, None]
        cos_b, sin_b = self.rope((position_ids[None] + offsets).flatten(0, 1))  # [b*B, T, d]
        hidden = self.embed_tokens(ids.flatten(0, 1))  # [b*B, T, H], frozen
        for layer in self.layers:
            run = _LayerRun(layer, size, B, bias, self.attn_impl)
            if checkpoint:  # recompute the layer in backward: keeps its inputs only
                hidden = activation_checkpoint(
                    run, hidden, context, cos_b, sin_b, cos_c, sin_c, use_reentrant=False
                )
            else:
                hidden = run(hidden, context, cos_b, sin_b, cos_c, sin_c)
        return list(self.norm(hidden).view(size, B, T, -1)[first:].unbind(0))

    def anchor_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        anchors: torch.Tensor,
        doc_start: torch.Tensor,
        size: int | None = None,
        checkpoint: bool = False,
        first: int = 1,
    ) -> list[torch.Tensor]:
        """The blocks of `anchors` [B, A] (slots of each row; --max-anchors) only: block_forward's blocks at
        those slots, each offset [B, A, H]. The block queries of all anchors run as one sequence against the
        row's context keys and every anchor's block keys, under a boolean mask: anchor a's queries see the
        context t' in [doc_start[a], a] and their own block (doc_start [B, T]: the first slot of each slot's
        document). A step then runs A x size queries per row instead of T x size."""
        size = size or self.block_size
        B, T = input_ids.shape
        A = anchors.shape[1]
        device = input_ids.device
        context = self.context(aux_hidden)  # [B, T, H]
        cos_c, sin_c = self.rope(position_ids)
        ids = torch.cat(
            [input_ids.gather(1, anchors)[..., None], self.mask_ids((B, A, size - 1), device)], -1
        )
        offsets = torch.arange(1, size + 1, device=device)
        cos_b, sin_b = self.rope(
            (position_ids.gather(1, anchors)[..., None] + offsets).flatten(1)
        )  # [B, A*b, d]
        hidden = self.embed_tokens(ids.flatten(1))  # [B, A*b, H], frozen
        t = torch.arange(T, device=device)
        sees = (t <= anchors[..., None]) & (
            t >= doc_start.gather(1, anchors)[..., None]
        )  # [B, A, T]
        own = (
            torch.eye(A, dtype=torch.bool, device=device)
            .repeat_interleave(size, 0)
            .repeat_interleave(size, 1)
        )
        mask = torch.cat([sees.repeat_interleave(size, 1), own.expand(B, -1, -1)], -1)[
            :, None
        ]  # [B, 1, Ab, T+Ab]
        for layer in self.layers:
            run = _AnchorRun(layer, mask)
            if checkpoint:
                hidden = activation_checkpoint(
                    run, hidden, context, cos_b, sin_b, cos_c, sin_c, use_reentrant=False
                )
            else:
                hidden = run(hidden, context, cos_b, sin_b, cos_c, sin_c)
        return list(self.norm(hidden).view(B, A, size, -1)[:, :, first:].unbind(2))

    # -- decoding ------------------------------------------------------------------------------

    def add_context(self, aux: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> None:
        """Append the context keys and values of aux [1, m, n*H_t] at position_ids [1, m] to `cache`."""
        context = self.context(aux)
        cos, sin = self.rope(position_ids)
        for i, layer in enumerate(self.layers):
            cache.update(i, *layer.self_attn.kv(context, cos, sin))

    def draft_block(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """One block forward: input_ids [1, b] ([newest token, masks]) at position_ids [1, b], attending to
        the whole `cache` (the context) and the whole block; the cache is left as it was. Returns the
        final states [1, b, H] (vLLM samples offsets 1 .. b - 1)."""
        cos, sin = self.rope(position_ids)
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):

            def attend(q, k, v, i=i):
                if cache.k[i] is not None:
                    k, v = torch.cat([cache.k[i], k], 2), torch.cat([cache.v[i], v], 2)
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            hidden = layer(hidden, cos, sin, attend)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final (normed) state -> [..., Vd]."""
        return self.lm_head(hidden)


class _LayerRun:
    """One layer over all the blocks of a batch: the b block offsets ride in the batch dim ([b*B, T]);
    offset j's queries attend causally to the context keys (t' <= t, within the document) plus the b
    block keys at their own slot (TTT attention's extra keys: exact, no [T, T] scores)."""

    def __init__(self, layer: BlockLayer, size: int, rows: int, bias, impl: str):
        self.layer, self.size, self.rows, self.bias, self.impl = layer, size, rows, bias, impl

    def __call__(self, hidden, context, cos_b, sin_b, cos_c, sin_c):
        attn = self.layer.self_attn
        k_ctx, v_ctx = attn.kv(context, cos_c, sin_c)  # [B, hkv, T, d]

        def attend(q, k, v):
            ks, vs = list(k.split(self.rows)), list(v.split(self.rows))
            outs = [
                ttt_attention(qj, k_ctx, v_ctx, ks, vs, bias=self.bias, impl=self.impl)
                for qj in q.split(self.rows)
            ]
            return torch.cat(outs)

        return self.layer(hidden, cos_b, sin_b, attend)


class _AnchorRun:
    """One layer over the anchored blocks of a batch ([B, A*b] queries), under anchor_forward's mask."""

    def __init__(self, layer: BlockLayer, mask: torch.Tensor):
        self.layer, self.mask = layer, mask

    def __call__(self, hidden, context, cos_b, sin_b, cos_c, sin_c):
        attn = self.layer.self_attn
        k_ctx, v_ctx = attn.kv(context, cos_c, sin_c)  # [B, hkv, T, d]

        def attend(q, k, v):
            k, v = torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2)
            repeat = q.shape[1] // k.shape[1]  # (GQA by hand: the masked kernels take equal heads)
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)

        return self.layer(hidden, cos_b, sin_b, attend)


def block_size(config: DraftConfig) -> int:
    return int(config.extra.get("block_size", 0))
