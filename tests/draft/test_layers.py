"""spec_cli/draft/layers.py: rope as transformers computes it (default, linear, llama3, YaRN with its
cos/sin scale), and the error for a rope type the draft cannot compute."""

import pytest
import torch

from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.layers import rope_inv_freq
from spec_cli.errors import ConfigError
from tests.draft import (
    one_thread,  # noqa: F401 (autouse fixture)
    tiny_config,
)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.8,
            "mscale_all_dim": 0.5,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.3,
            "truncate": False,
        },
    ],
)
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config(head_dim=64, hidden_size=256, rope_theta=500000.0, rope_scaling=scaling)
    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    hf = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        rope_parameters=params,
        max_position_embeddings=4096,
    )
    kind = params["rope_type"]
    if kind == "default":
        expected, scale = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64), 1.0
    else:
        expected, scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), expected.float())
    # yarn scales cos/sin (transformers' attention_scaling, vLLM's mscale); the others leave them
    draft = Eagle3Draft(cfg)
    pos = torch.arange(50).expand(1, 50)
    cos, sin = draft.rope(pos)
    freqs = pos[..., None].float() * expected.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    torch.testing.assert_close(cos, emb.cos() * scale)
    torch.testing.assert_close(sin, emb.sin() * scale)
    assert (scale != 1.0) == (kind == "yarn")


def test_unsupported_rope_is_a_clear_error():
    with pytest.raises(ConfigError, match="rope type 'longrope'") as caught:
        Eagle3Draft(tiny_config(rope_scaling={"rope_type": "longrope", "factor": 4.0}))
    assert "--draft-rope-theta" in caught.value.hint
