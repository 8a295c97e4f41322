"""vLLM 0.32's own DSpark heads (qwen3_dspark.py DSparkMarkovHead and DSparkConfidenceHead, built outside an
engine: vLLM serves DSpark only in its V2 model runner, which needs Triton with a GPU) load a DSpark draft's
head weights under the names spec_cli exports and compute what spec_cli's draft computes: the Markov bias
of a previous token through vLLM's logits processor, and the confidence head's probability in fp32."""

from __future__ import annotations

import socket

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_heads():
    from spec_cli.engine import vllm as engine

    engine.configure_env()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models import qwen3_dspark

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        try:
            yield qwen3_dspark, LogitsProcessor
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


@pytest.mark.parametrize("with_markov", [True, False])
def test_vllms_heads_load_the_exported_names_and_compute_the_drafts_values(vllm_heads, with_markov):
    from tests.draft.dspark.test_model import RANK, dspark_draft

    qwen3_dspark, LogitsProcessor = vllm_heads
    draft = dspark_draft(seed=7, with_markov=with_markov)
    c = draft.config
    state = {k: v.detach() for k, v in draft.state_dict().items()}
    markov = qwen3_dspark.DSparkMarkovHead(
        c.vocab_size, c.draft_vocab_size, RANK, prefix="model.markov_head"
    )
    width = c.hidden_size + (RANK if with_markov else 0)
    confidence = qwen3_dspark.DSparkConfidenceHead(
        width, prefix="model.confidence_head", bias=True, with_markov=with_markov
    )
    for prefix, module in (("markov_head.", markov), ("confidence_head.", confidence)):
        names = {n for n, _ in module.named_parameters()}
        assert {prefix + n for n in names} == {
            k for k in state if k.startswith(prefix)
        }  # the exported names
        for name, param in module.named_parameters():
            loader = getattr(param, "weight_loader", None)
            tensor = state[prefix + name].to(param.dtype)
            loader(param, tensor) if loader else param.data.copy_(tensor)
        for (
            sub
        ) in module.modules():  # as vLLM's loader finishes every module (the CPU kernels' packing)
            if getattr(sub, "quant_method", None) is not None:
                sub.quant_method.process_weights_after_loading(sub)
    assert confidence.proj.weight.dtype == torch.float32  # vLLM builds the head in fp32
    previous = torch.randint(0, c.vocab_size, (5,))
    hidden = torch.randn(5, c.hidden_size)
    with torch.no_grad():
        embed = markov.embed(previous)
        bias = markov.bias(embed, LogitsProcessor(c.draft_vocab_size, scale=1.0))
        prob = torch.sigmoid(confidence(hidden, embed))
        ours = draft.markov_embed(previous)
        torch.testing.assert_close(embed, ours)
        torch.testing.assert_close(bias, draft.markov_head.markov_w2(ours), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            prob, torch.sigmoid(draft.confidence_logit(hidden, ours)), rtol=1e-6, atol=1e-6
        )
