"""The draft model's configuration, derived from the target's config and the vocab map."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from spec_cli.errors import ConfigError


@dataclass
class DraftConfig:
    # target side
    vocab_size: int  # target vocab V (rows of the target lm_head / embed_tokens)
    target_hidden_size: int  # H_t: each aux state has this width; fc reads 3 * H_t
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
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    # EAGLE-3.1 options
    fc_norm: bool = False  # one RMSNorm per aux chunk before fc
    norm_output: bool = False  # feed the post-norm state to the next TTT step
    # provenance (checked by later stages)
    target_architecture: str = ""
    target_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    vocab_map_fingerprint: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_hidden_layers < 1:
            raise ConfigError("the draft needs at least 1 decoder layer", "use --draft-layers 1 or more")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"draft heads {self.num_attention_heads} not divisible by kv heads "
                              f"{self.num_key_value_heads}", "choose kv heads that divide the heads")
        if len(self.aux_layer_ids) != 3:
            raise ConfigError("EAGLE-3 drafts read exactly three aux layers", "pass three --aux-layers")

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int],
                    **overrides) -> "DraftConfig":
        """Llama-style layer shaped like the target's (hidden size, heads, rope), overridable."""
        text = target_config
        if getattr(text, "num_hidden_layers", None) is None and getattr(text, "text_config", None):
            text = text.text_config
        heads = text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        rope_scaling = None if rope_type == "default" else {
            k: v for k, v in rope.items() if k != "rope_theta"}
        values = dict(
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            target_num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            target_architecture=(getattr(target_config, "architectures", None) or [""])[0],
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown draft option(s) {sorted(unknown)}", "check the option names")
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "hidden_size" in overrides and overrides["hidden_size"] and "head_dim" not in overrides:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: Path) -> None:
        from spec_cli.artifacts.io import write_json

        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> "DraftConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
