"""A live target under --context-parallel (spec_cli/targets/group.py): loaded on the group's first rank
only, it runs the group's whole rows and hands each rank its slots. Under torchrun (gloo, two ranks)
every rank's batch equals, bit for bit, the whole target's batch run in one process, padded to the
group's chunks and cut to that rank's kept ranges; the facts, embeddings and output head reach the rank
that holds no target."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.draft.context import kept_ranges, pad_rows
from spec_cli.targets.group import take_slots
from spec_cli.targets.hf_backend import HFTargetBackend
from tests.launch import torchrun

HALO = 2  # TTT 3 reads two slots ahead
CASES = {"rows": (False, False), "packed": (False, True), "eagle-final-hidden": (True, False)}


def vocab() -> torch.Tensor:
    return torch.sort(torch.randperm(400, generator=torch.Generator().manual_seed(3))[:64]).values


def inputs(packed: bool) -> dict:
    """Rows as inputs_for gives them under --context-parallel 2: padded to a multiple of 4 slots."""
    gen = torch.Generator().manual_seed(5)
    if packed:
        ids = torch.randint(5, 400, (1, 29), generator=gen)
        am = torch.ones_like(ids)
        kw = {"seq_lens": torch.tensor([[11, 12, 6]])}
    else:
        ids = torch.randint(5, 400, (2, 21), generator=gen)
        am = torch.ones_like(ids)
        am[1, 15:] = 0
        kw = {}
    lm = (torch.rand(ids.shape, generator=gen) < 0.7).long() * am
    pad = (0, 3)  # 21 or 29 slots -> 24 or 32
    return {
        "input_ids": torch.nn.functional.pad(ids, pad),
        "attention_mask": torch.nn.functional.pad(am, pad),
        "loss_mask": torch.nn.functional.pad(lm, pad),
        **kw,
    }


@pytest.mark.slow
def test_each_rank_gets_its_slots_of_the_whole_targets_batch(tiny_llama_dir, tmp_path, one_thread):
    """(One intra-op thread here, as in the launched ranks: the same sums in the same order.)"""
    out = tmp_path / "out"
    torchrun([["-m", "tests.targets.group_cp", tiny_llama_dir, out]], tmp_path / "launch")
    whole_target = HFTargetBackend(tiny_llama_dir, None, device="cpu", dtype="fp32")
    whole_target.set_vocab_mapping(vocab())
    got = [load_file(str(out / f"rank{r}.safetensors")) for r in (0, 1)]
    said = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["loaded"] for s in said] == [True, False]  # the second rank holds no target
    assert said[1]["info"] == said[0]["info"] == json.loads(json.dumps(whole_target.info))
    head = whole_target.get_output_head()
    for r in (0, 1):
        assert torch.equal(got[r]["embeddings"], whole_target.get_input_embeddings())
        assert {k[5:] for k in got[r] if k.startswith("head.")} == set(head)
        assert all(torch.equal(got[r][f"head.{k}"], v) for k, v in head.items())
    for name, (final_hidden, packed) in CASES.items():
        whole_target.keep_final_hidden = final_hidden
        kw = inputs(packed)
        T = kw["input_ids"].shape[1]
        real = 29 if packed else 21  # what one process collates: the rows at their own length
        cut = {k: (v if k == "seq_lens" else v[:, :real]) for k, v in kw.items()}
        whole = pad_rows(whole_target.generate_batch(**cut), T)
        for r in (0, 1):
            want = take_slots(whole, kept_ranges(2, r, T, HALO)).tensors()
            mine = {k[len(name) + 1 :]: v for k, v in got[r].items() if k.startswith(name + ".")}
            assert set(mine) == set(want), (name, r)
            assert ("final_hidden" in mine) == final_hidden
            for k, v in want.items():
                assert mine[k].dtype == v.dtype and torch.equal(mine[k], v), (name, r, k)
            assert (
                mine["aux_hidden"].shape[1] == sum(b - a for a, b in kept_ranges(2, r, T, HALO)) < T
            )
    whole_target.close()
