"""What every draft that decodes one slot at a time shares: rope at the slot's position, one TTT
step over whole rows (training), and incremental decoding against a KV cache (eval).

A subclass provides `config` (a DraftConfig), `fc` (its dtype is the model's), `decoder_layers`,
`_layers(input_ids, state, cos, sin, attends) -> (next state, [(k, v)] per layer)` and
`project(inputs) -> state`; `attn_impl` picks the TTT attention kernel (auto | fused | math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from spec_cli.draft.attention import ttt_attention, with_window
from spec_cli.draft.layers import KVCache, rope_attention_scale, rope_inv_freq


class SteppedDraft(nn.Module):
    attn_impl = "auto"  # TTT attention kernel: auto | fused | math
    hidden_noise = (
        0.0  # --hidden-noise: relative noise on the target's states in training (project)
    )
    noise_offset = None  # --context-parallel: this rank's place in its group (layers.feature_noise)

    def new_cache(self) -> KVCache:
        """An empty decoding cache for this draft's layers."""
        return KVCache(self.config.num_hidden_layers)

    def rope(self, position_ids: torch.Tensor):
        """[B, T] positions -> cos, sin [B, T, head_dim] in the model dtype."""
        inv_freq = self._inv_freq(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        dtype = self.fc.weight.dtype
        scale = rope_attention_scale(self.config)  # yarn only; 1 otherwise
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """rope's inverse frequencies, fp32 always (a buffer would be cast by .to(bfloat16)): computed on
        the host as the engines do, copied to `device` once and kept. A copy per call made the host wait
        for the GPU once per TTT step (a host -> device copy from pageable memory syncs)."""
        kept = self.__dict__.get("_rope_inv_freq")
        if kept is None or kept.device != device:
            kept = rope_inv_freq(self.config).to(device)
            if not is_fake(kept):  # `spec plan`'s fake tensors stay in its own step
                self.__dict__["_rope_inv_freq"] = kept
        return kept

    # -- TTT (training) --------------------------------------------------------------------------

    def ttt_step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[list],
        bias: torch.Tensor | None = None,
        checkpoint: bool = False,
    ) -> torch.Tensor:
        """One TTT step over whole rows.

        input_ids [B, T]; hidden [B, T, H]: project(aux) at step 0, the previous step's state after;
        caches: one list per layer of the (k, v) of earlier steps ([0] = step 0), appended to here;
        bias: None (causal), attention.Segments (packed) or block_causal_bias. Returns the state for the next step [B, T, H].
        """
        attends = [
            _ttt_attend(list(cache), bias, self.attn_impl, self.config.sliding_window)
            for cache in caches
        ]
        if checkpoint:  # recompute the layers in backward: keeps only their inputs and k/v
            state, kvs = activation_checkpoint(
                self._layers, input_ids, hidden, cos, sin, attends, use_reentrant=False
            )
        else:
            state, kvs = self._layers(input_ids, hidden, cos, sin, attends)
        for cache, kv in zip(caches, kvs):
            cache.append(kv)
        return state

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Step 0 over whole rows (causal): [B, T] ids, what `project` reads [B, T, ...] -> state [B, T, H]."""
        B, T = input_ids.shape[:2]  # (ids [B, T], or embeddings [B, T, H]: MSD)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = self.rope(position_ids)
        caches = [[] for _ in self.decoder_layers]
        return self.ttt_step(input_ids, self.project(aux_hidden), cos, sin, caches, bias)

    # -- incremental decoding --------------------------------------------------------------------

    def forward_step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode n new positions against the cache: input_ids [B, n], hidden [B, n, H]
        (project(aux) for positions the target verified, the draft's own state when drafting),
        position_ids [B, n]. attn_mask [B, 1, n, L_old + n] bool (True = attend) for tree drafts;
        default causal. Appends to `cache`; returns the states [B, n, H] (`logits` of them predict
        the next tokens)."""
        n, past = input_ids.shape[1], len(cache)
        if attn_mask is None:
            attn_mask = torch.ones(n, past + n, dtype=torch.bool, device=input_ids.device).tril(
                past
            )
        window = self.config.sliding_window
        if window is not None:  # --draft-window: keys at positions > the query's - W (vLLM's rule)
            keys = cache.add_positions(position_ids[0])  # [past + n] each cached slot's position
            attn_mask = attn_mask & (keys[None, :] > position_ids[0][:, None] - window)
        cos, sin = self.rope(position_ids)

        def attend_fn(i):
            def attend(q, k, v):
                k, v = cache.update(i, k, v)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)

            return attend

        attends = [attend_fn(i) for i in range(len(self.decoder_layers))]
        state, _ = self._layers(input_ids, hidden.to(self.fc.weight.dtype), cos, sin, attends)
        return state


def _ttt_attend(cache: list, bias, impl: str, window: int | None = None):
    """Layer attention at TTT step k = len(cache): step 0 is causal over its own keys; later steps
    attend the step-0 prefix plus each position's own keys from steps 1..k (`cache` + this step).

    window (--draft-window W): attention sees the keys of the last W positions, as the engines serve a
    sliding-window layer (vLLM: key position > query position - W). Slot t's query sits at position
    t + k at step k and its extra keys at t + 1 .. t + k (all inside, as W > k), so of the step-0 keys
    it sees those at positions t + k - W + 1 .. t: a window of W - k slots."""

    def attend(q, k, v):
        step_bias = (
            bias
            if window is None
            else with_window(bias, window - len(cache), q.shape[0], q.shape[2])
        )
        if not cache:
            return ttt_attention(q, k, v, bias=step_bias, impl=impl)
        (k0, v0), later = cache[0], cache[1:]
        extra_k = [kv[0] for kv in later] + [k]
        extra_v = [kv[1] for kv in later] + [v]
        return ttt_attention(q, k0, v0, extra_k, extra_v, bias=step_bias, impl=impl)

    return attend
