"""`spec plan`'s memory figures (the training step run on fake tensors, spec_cli/plan/) against a real
CPU run of the same step: the CPU allocator's own peak, read from torch's profiler (every allocation
and free it reports, with the running total), for EAGLE-3, EAGLE-1/2 and DFlash, with and without activation
checkpointing. The plan cannot see an op's internal scratch, so it may read a little low: the
tolerance is 2% of the step's memory above what is resident, and the resident bytes (weights, AdamW
state, the batch) must match exactly."""

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from spec_cli.batch import TargetBatch
from spec_cli.draft import algorithms
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.step import forward_backward, make_optimizer, optimizer_step
from spec_cli.plan.step import measure_step
from spec_cli.train_options import ObjectiveOptions, OptimOptions

B, T, V = 2, 384, 640


def config(algorithm) -> DraftConfig:
    a = algorithms.get(algorithm)
    return DraftConfig(
        vocab_size=V,
        target_hidden_size=96,
        aux_layer_ids=a.default_aux_layers(8)[: a.aux_layers],
        target_num_layers=8,
        hidden_size=96,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        draft_vocab_size=V if algorithm == "eagle" else 160,
        algorithm=algorithm,
        **({"mask_token_id": 5, "extra": {"block_size": 8}} if algorithm == "dflash" else {}),
        **(
            {
                "mask_token_id": 5,
                "extra": {
                    "block_size": 8,
                    "markov_rank": 256,
                    "confidence_head": True,
                    "confidence_with_markov": True,
                },
            }
            if algorithm == "dspark"
            else {}
        ),
    )


def real_batch(cfg: DraftConfig, final_hidden: bool) -> TargetBatch:
    """Every slot real and supervised but each row's last (nothing to predict there), as the plan
    assumes."""
    gen = torch.Generator().manual_seed(0)
    ones = torch.ones(B, T, dtype=torch.long)
    supervised = ones.clone()
    supervised[:, -1] = 0
    return TargetBatch(
        aux_hidden=torch.randn(
            B, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=gen
        ),
        input_ids=torch.randint(0, V, (B, T), generator=gen),
        attention_mask=ones,
        loss_mask=supervised,
        target_p=torch.rand(B, T, cfg.draft_vocab_size, generator=gen).softmax(-1),
        position_mask=supervised.bool(),
        target_ids=torch.randint(0, V, (B, T), generator=gen),
        target_mass=torch.ones(B, T),
        final_hidden=torch.randn(B, T, cfg.target_hidden_size) if final_hidden else None,
    )


def measured(algorithm: str, checkpointing: bool) -> tuple[int, int]:
    """(resident bytes, peak above resident) of a real fp32 CPU step, the second (AdamW's state made)."""
    a = algorithms.get(algorithm)
    cfg = config(algorithm)
    torch.manual_seed(0)
    draft = a.build(cfg)
    if hasattr(draft, "set_vocab_map") and algorithm != "eagle":
        draft.set_vocab_map(torch.arange(cfg.draft_vocab_size))
    objective = a.objective(draft, ObjectiveOptions(), activation_checkpointing=checkpointing)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, OptimOptions())
    batch = real_batch(cfg, "final_hidden" in a.needs)
    autocast = torch.autocast("cpu", enabled=False)

    def step():
        forward_backward(objective, objective, batch, 1, autocast)
        optimizer_step(params, optimizer, 1.0)

    step()
    resident = sum(
        t.untyped_storage().nbytes()
        for t in [
            *draft.parameters(),
            *draft.buffers(),
            *batch.tensors().values(),
            *(v for s in optimizer.state.values() for v in s.values()),
        ]
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append(
                (
                    node.start_time_ns,
                    node.extra_fields.alloc_size,
                    node.extra_fields.total_allocated,
                )
            )
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort()
    start = events[0][2] - events[0][1]  # allocated before the step's first allocation
    return resident, max(total for _, _, total in events) - start


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "dflash", "dspark"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_matches_a_real_cpu_step(algorithm, checkpointing):
    torch.set_num_threads(1)
    resident, above = measured(algorithm, checkpointing)
    plan = measure_step(
        algorithms.get(algorithm),
        config(algorithm),
        ObjectiveOptions(),
        T,
        batch=B,
        activation_checkpointing=checkpointing,
        autocast_dtype=None,
        target_dtype=torch.float32,
    )
    print(algorithm, checkpointing, resident, plan.resident, above, plan.peak - plan.resident)
    assert plan.resident == resident
    assert abs((plan.peak - plan.resident) - above) <= 0.02 * above
