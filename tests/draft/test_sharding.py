"""FSDP2's mixed precision as the GPU path sets it, run for real on CPU in a one-process gloo group:
the weights the forward computes with are bf16, the batch's tensors reach it uncast (the target's
probabilities stay fp32), the gradients come back reduced in fp32 and sharded, and the root's
no-sync context accumulates. (Two processes, DDP and FSDP2 against one: tests/test_distributed.py.)"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spec_cli.draft import sharding
from tests.launch import free_port


@dataclass
class Batch:
    hidden: torch.Tensor  # [T, H]
    target_p: torch.Tensor  # [T, V] the target's probabilities, fp32


class Objective(nn.Module):
    """Stands for an algorithm's objective: holds the draft, calls its pieces directly."""

    def __init__(self):
        super().__init__()
        self.draft = nn.ModuleDict(
            {"fc": nn.Linear(8, 8, bias=False), "lm_head": nn.Linear(8, 5, bias=False)}
        )
        self.seen = {}

    def forward(self, batch: Batch):
        self.seen = {"weight": self.draft["fc"].weight.dtype, "target_p": batch.target_p.dtype}
        h = batch.hidden
        for _ in range(3):  # a TTT-like unroll: the same piece called several times
            h = self.draft["fc"](h.to(self.draft["fc"].weight.dtype))
        logp = torch.log_softmax(self.draft["lm_head"](h).float(), -1)
        return -(batch.target_p * logp).sum(-1).mean()


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("cpu:gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_gpu_policy_gathers_bf16_reduces_fp32_and_leaves_the_batch_alone():
    gpu, cpu = sharding.policy(torch.device("cuda")), sharding.policy(torch.device("cpu"))
    assert (gpu.param_dtype, gpu.reduce_dtype, gpu.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    assert (cpu.param_dtype, cpu.reduce_dtype, cpu.cast_forward_inputs) == (None, None, False)


def test_one_root_over_the_objective_computes_in_bf16_and_keeps_fp32_gradients(group):
    torch.manual_seed(0)
    objective = Objective()
    reference = Objective()
    reference.load_state_dict(objective.state_dict())
    sharding.shard(objective, torch.device("cuda"))  # the GPU policy, on CPU
    batch = Batch(torch.randn(4, 8), torch.softmax(torch.randn(4, 5), -1))

    with sharding.no_gradient_sync(objective):
        objective(batch).backward()
    objective(batch).backward()  # the step's last micro-batch: gradients reduced
    assert objective.seen == {"weight": torch.bfloat16, "target_p": torch.float32}

    reference_loss = reference(batch)
    (2 * reference_loss).backward()  # two micro-batches of the same batch, in fp32
    for name, param in objective.named_parameters():
        grad = param.grad.full_tensor()
        assert param.dtype == grad.dtype == torch.float32, (
            name
        )  # sharded fp32 master weights and grads
        expected = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(
            grad, expected, rtol=0.05, atol=0.02
        )  # bf16 compute, fp32 reduce
        assert not torch.equal(grad, expected)  # it did compute in bf16
