"""The draft model's configuration, derived from the target's config and the vocab map.

Rope. The draft layer's rotary embedding is taken from the target (`target_rope`), for every layout
transformers writes: a flat `rope_parameters` (transformers 5), `rope_theta` + `rope_scaling` (4.x, with
`type` or `rope_type`), and `rope_parameters` nested per layer type (Gemma 3: `full_attention` /
`sliding_attention`, each with its own theta and scaling). The draft is one full-attention layer that
attends over the whole context, so from a nested config it takes the `full_attention` entry: the
sliding layers' rope (Gemma 3: theta 10k, no scaling) is tuned for a 512-token window. Nothing falls
back silently: the choice is recorded in `rope_source` (README of every export, the train log), and a
scaling type the draft cannot compute is an error naming `--draft-rope-theta`, the explicit way to train
plain rope instead (the draft's rope is its own: it only has to agree between training and serving).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from spec_cli.errors import ConfigError

# Rope scaling types the draft computes the same way as transformers, vLLM and SGLang.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


@dataclass(frozen=True)
class RopeChoice:
    theta: float
    scaling: dict | None  # None: plain rope; else the scaling dict with `rope_type` (no theta)
    source: str  # where it came from, in words


def _scaling_of(entry: dict, max_positions: int | None) -> dict | None:
    """A rope dict -> its scaling part (theta and partial_rotary_factor dropped), `type` -> `rope_type`,
    with the fields the engines require filled the way transformers fills them."""
    out = {k: v for k, v in entry.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if (
        "type" in out
    ):  # 4.x spelling; transformers 5 merges a Gemma 3 `{"type": "linear"}` next to its
        old = out.pop(
            "type"
        )  # own "rope_type": "default", so the published `type` wins over that default
        if out.get("rope_type", "default") == "default":
            out["rope_type"] = old
    kind = out.get("rope_type", "default")
    if kind == "default":
        return None
    if (
        kind in ("llama3", "yarn")
        and out.get("original_max_position_embeddings") is None
        and max_positions
    ):
        out["original_max_position_embeddings"] = (
            max_positions  # transformers' standardize_rope_params
        )
    if kind == "yarn" and out.get("factor") is None and max_positions:
        out["factor"] = (
            max_positions / out["original_max_position_embeddings"]
        )  # _compute_yarn_parameters
    return out


def _text_attr(text, name: str):
    """A text config's attribute; where it differs between layers (Gemma 4: its full-attention layers'
    head_dim is twice the sliding ones') the value most layers have: the draft is one uniform layer."""
    try:
        return getattr(text, name, None)
    except Exception as exc:  # noqa: BLE001 (transformers' AmbiguousGlobalPerLayerAttributeError)
        layers = getattr(text, "per_layer_config", None)
        if layers is None:
            raise
        values = [getattr(layers[i], name, None) for i in range(text.num_hidden_layers)]
        if not any(v is not None for v in values):
            raise exc from None
        return Counter(v for v in values if v is not None).most_common(1)[0][0]


def target_rope(text) -> RopeChoice:
    """The rope the draft takes from the target's (text) config; see the module docstring."""
    params = getattr(text, "rope_parameters", None)
    legacy_theta = getattr(text, "rope_theta", None)
    max_positions = getattr(text, "max_position_embeddings", None)
    where = "rope_parameters"
    if not params:  # transformers 4.x layout (or a config transformers did not standardise)
        params = dict(getattr(text, "rope_scaling", None) or {})
        where = "rope_theta/rope_scaling"
    params = dict(params)
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    note = ""
    if nested:
        if "full_attention" in nested:
            key = "full_attention"
        elif len(nested) == 1:
            key = next(iter(nested))
        else:
            raise ConfigError(
                f"the target's rope_parameters are set per layer type ({', '.join(nested)}) and "
                "none is full_attention, so it is not clear which one a full-attention draft "
                "layer should copy",
                "pass --draft-rope-theta THETA to train plain rope",
            )
        others = ", ".join(
            f"{k}: theta {float(v.get('rope_theta', legacy_theta or DEFAULT_THETA)):g}"
            + (f", {v['rope_type']}" if v.get("rope_type", "default") != "default" else "")
            for k, v in nested.items()
            if k != key
        )
        entry = dict(nested[key])
        where = f"rope_parameters[{key!r}]"
        if others:
            note = (
                f"; the draft is a full-attention layer, so it copies the target's {key} layers, not "
                f"its other layer types ({others})"
            )
    else:
        entry = params
    theta = entry.get("rope_theta", legacy_theta)
    if theta is None:
        theta = DEFAULT_THETA
        note += f"; the target config names no rope theta, so transformers' default {DEFAULT_THETA:g} is used"
    scaling = _scaling_of(entry, max_positions)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "mrope" or "mrope_section" in entry or "mrope_section" in (scaling or {}):
        # Qwen2-VL / 2.5-VL / 3-VL's multimodal rope: the sections go, a scaling on top of it (yarn) stays
        scaling = {
            k: v
            for k, v in (scaling or {}).items()
            if k not in ("mrope_section", "mrope_interleaved")
        }
        kind = scaling.get("rope_type", "default")
        if kind in ("mrope", "default"):
            scaling, kind = None, "default"
        note += (
            "; the target's M-RoPE rotates by (temporal, height, width) positions, which are all the "
            "token's index on text; vLLM hands a plain-rope draft the first (temporal) one, so the draft "
            f"is {'plain' if scaling is None else kind} rope at the target's theta"
        )
    if (
        kind == "proportional"
    ):  # Gemma 4's full-attention layers: rope on a part of each head, the rest
        scaling, kind = (
            None,
            "default",
        )  # unrotated; the draft (a Llama layer) rotates all of its head
        note += "; its proportional rope is plain rope at this theta on a part of each head"
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"the target's rope scaling {kind!r} ({where}) is not one the draft computes "
            f"({', '.join(ROPE_TYPES)})",
            "pass --draft-rope-theta THETA to train the draft with plain rope at that theta",
        )
    partial = entry.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        note += (
            f"; the target rotates {partial:g} of each head, the draft (a Llama layer, as the engines "
            "build it) all of its head"
        )
    described = f"theta {float(theta):g}" + (
        f", {kind} scaling {_fields(scaling)}" if scaling else ""
    )
    return RopeChoice(float(theta), scaling, f"target {where}: {described}{note}")


def _fields(scaling: dict) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in scaling.items() if k != "rope_type") + ")"


@dataclass
class DraftConfig:
    # target side
    vocab_size: int  # target vocab V (rows of the target lm_head / embed_tokens)
    target_hidden_size: int  # H_t: each aux state has this width; fc reads len(aux_layer_ids) * H_t
    aux_layer_ids: list[int]  # spec_cli convention: 0-indexed decoder layer OUTPUTS
    target_num_layers: int
    # draft layer (Llama-style)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_source: str = ""  # where the rope settings came from (target_rope), in words
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    sliding_window: int | None = (
        None  # --draft-window: the draft's attention sees the last W positions
    )
    # EAGLE-3.1 options
    fc_norm: bool = False  # one RMSNorm per aux chunk before fc
    norm_output: bool = False  # feed the post-norm state to the next TTT step
    # provenance (checked by later stages)
    target_architecture: str = ""
    target_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    chat_template_sha256: str | None = None  # the template the training data was rendered with
    chat_template_source: str = ""
    tokenizer_base_fingerprint: str = ""  # the tokenizer without its template (tells the two apart)
    vocab_map_fingerprint: str = ""
    mask_token_id: int | None = None  # P-EAGLE: the token of the mask slots (parallel drafting)
    algorithm: str = (
        "eagle3"  # the draft algorithm (spec_cli/draft/algorithms.py); older checkpoints: eagle3
    )
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(
                f"a sliding window of {self.sliding_window} positions",
                "use --draft-window 1 or more",
            )
        if self.num_hidden_layers < 1:
            raise ConfigError(
                "the draft needs at least 1 decoder layer", "use --draft-layers 1 or more"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"draft heads {self.num_attention_heads} not divisible by kv heads "
                f"{self.num_key_value_heads}",
                "choose kv heads that divide the heads",
            )

    @classmethod
    def from_target(
        cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int], **overrides
    ) -> DraftConfig:
        """Llama-style layer shaped like the target's (hidden size, heads, rope), overridable."""
        text = target_config
        if getattr(text, "num_hidden_layers", None) is None and getattr(text, "text_config", None):
            text = text.text_config
        heads = text.num_attention_heads
        if (
            overrides.get("rope_theta") is not None
        ):  # --draft-rope-theta: plain rope, chosen by the user
            rope = RopeChoice(
                float(overrides["rope_theta"]),
                None,
                f"--draft-rope-theta: theta {float(overrides['rope_theta']):g}, no scaling "
                "(not taken from the target)",
            )
            overrides = {
                k: v for k, v in overrides.items() if k not in ("rope_theta", "rope_scaling")
            }
        else:
            rope = target_rope(text)
        values = dict(
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            target_num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            # the target's `intermediate_size` field (an MoE's dense MLP width, or gpt-oss's expert width:
            # docs/moe.md), 3 x hidden where an MoE config has none, as speculators does
            intermediate_size=_text_attr(text, "intermediate_size") or 3 * text.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=_text_attr(text, "num_key_value_heads") or heads,
            head_dim=_text_attr(text, "head_dim") or text.hidden_size // heads,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            rope_source=rope.source,
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            target_architecture=(getattr(target_config, "architectures", None) or [""])[0],
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(
                f"unknown draft option(s) {sorted(unknown)}", "check the option names"
            )
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "hidden_size" in overrides and overrides["hidden_size"] and "head_dim" not in overrides:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DraftConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: Path) -> None:
        from spec_cli.artifacts.io import write_json

        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> DraftConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
