"""Llama-style building blocks every draft uses: rotary embeddings (default, linear, llama3, YaRN, as
the serving engines compute them), RMSNorm, the attention projections, the MLP and a KV cache for decoding."""

from __future__ import annotations

import math

import torch
from torch import nn

from spec_cli.draft.config import DraftConfig
from spec_cli.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# rotary embeddings


def _yarn(
    inv_freq: torch.Tensor, base: float, d: int, scaling: dict, max_positions: int
) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters; vLLM's YaRNScalingRotaryEmbedding): dims that rotate
    fast enough keep their frequency, slow ones are interpolated by `factor`, a linear ramp in between."""
    factor, old_len = (
        scaling["factor"],
        scaling.get("original_max_position_embeddings") or max_positions,
    )
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over old_len
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = (
        (torch.arange(d // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)
    ).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_scale(config: DraftConfig) -> float:
    """YaRN's factor on cos/sin (1 for other rope types): `attention_factor`, else from mscale."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def rope_inv_freq(config: DraftConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) for default, linear, llama3 and yarn rope."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = (
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
        )
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn(inv_freq, config.rope_theta, d, scaling, config.max_position_embeddings)
    raise ConfigError(
        f"rope type {kind!r} is not supported by the draft model",
        "supported: default, linear, llama3, yarn; train with --draft-rope-theta THETA",
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos, sin [B, T, d]. In x's dtype: under bf16 autocast q and k come out of
    their projections in bf16, and fp32 tables would turn them fp32 beside a bf16 v (the attention
    kernels take one dtype)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


# ---------------------------------------------------------------------------------------------
# blocks


def feature_noise(
    x: torch.Tensor, std: float, parts: int = 1, offset: int | None = None
) -> torch.Tensor:
    """x + std * RMS * N(0, 1): Gaussian noise on the target's states, relative to each state's size
    (the RMS per token over each of `parts` equal slices of the last dim: EAGLE-3's aux states are
    three layers' states side by side, of different sizes). Training only: the draft learns to
    continue from states a little off, as its own predictions are when it drafts.

    offset: a context-parallel rank's place in its group. Its ranks share the global RNG's state (one
    seed, one checkpointed state), so each draws from a generator seeded with one draw of it plus the
    offset: different noise for each rank's slots, the same on a resume."""
    slices = x.unflatten(-1, (parts, -1))  # [..., parts, H]
    rms = slices.detach().float().pow(2).mean(-1, keepdim=True).sqrt()
    generator = None
    if offset is not None:  # (a host draw from the CPU generator: no device sync)
        generator = torch.Generator(x.device).manual_seed(int(torch.randint(2**62, (1,))) + offset)
    noise = (
        torch.randn(slices.shape, device=x.device, dtype=torch.float32, generator=generator)
        * rms
        * std
    )
    return (slices + noise.to(x.dtype)).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if x.element_size() < 4 else x  # half precision: normalise in fp32
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """The projections of a Llama attention block; the attention itself is passed in (`attend`)."""

    def __init__(self, config: DraftConfig, input_size: int):
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(input_size, h * d, bias=False)
        self.k_proj = nn.Linear(input_size, kv * d, bias=False)
        self.v_proj = nn.Linear(input_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, in] -> q [B, h, T, d], k, v [B, hkv, T, d] (rope applied to q and k)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, h, T, d] -> [B, T, H]."""
        return self.o_proj(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------
# incremental decoding


class KVCache:
    """Keys/values per layer for decoding, [B, hkv, L, d] each; all rows share one length."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = (
            None  # [L] each slot's position (kept by windowed drafts)
        )

    def add_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Record the positions [n] of the slots this call appends; returns every slot's [L + n]. (Tree
        drafts put several slots at one position, so a slot's index is not its position.)"""
        if self.positions is None:
            if len(self):
                raise RuntimeError("the cache holds slots whose positions were not recorded")
            self.positions = positions.clone()
        else:
            self.positions = torch.cat([self.positions, positions])
        return self.positions

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append this call's k, v [B, hkv, n, d]; return the whole cache of the layer."""
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drop rejected speculative tokens)."""
        self.k = [None if k is None else k[:, :, :length] for k in self.k]
        self.v = [None if v is None else v[:, :, :length] for v in self.v]
        if self.positions is not None:
            self.positions = self.positions[:length]
