"""States filed by token prefix (spec regenerate --features): a row is put together only from states
computed with exactly its prefix, whichever request computed them."""

import torch

from spec_cli.targets.prefix_states import PrefixStates, prefix_keys


def states_of(tokens: list[int], H: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in causal model: the state at p is a function of tokens[0..p] only."""
    keys = torch.tensor(prefix_keys(tokens), dtype=torch.float64)
    hidden = torch.stack([keys % 1000 + k for k in range(H)], 1)
    return hidden, -2 * hidden


def test_keys_identify_the_whole_prefix():
    a, b = prefix_keys([1, 2, 3, 4]), prefix_keys([9, 2, 3, 4])
    assert a[:1] != b[:1] and all(
        x != y for x, y in zip(a, b)
    )  # one token apart at 0: every key differs
    assert prefix_keys([1, 2, 3, 5])[:3] == a[:3] and prefix_keys([1, 2, 3, 5])[3] != a[3]


def test_a_row_is_put_together_from_the_requests_that_computed_its_prefixes():
    store = PrefixStates()
    prompt, answer = [5, 6, 7, 8], [11, 12, 13]
    h, a = states_of(prompt + answer)
    store.add("turn1", torch.arange(4), h[:4], a[:4])  # the prefill
    for p in (4, 5):  # two decode steps; the last sampled token (13) is never run
        store.add("turn1", torch.tensor([p]), h[p : p + 1], a[p : p + 1])
    assert store.commit("turn1", prompt + answer) == 6

    row = prompt + answer + [2, 3]  # the next turn: its own tail, the rest cached
    h2, a2 = states_of(row)
    out_h, out_a = (
        torch.zeros(len(row), 3, dtype=torch.float64),
        torch.zeros(len(row), 3, dtype=torch.float64),
    )
    assert store.fill(row, out_h, out_a) == 3  # 13, 2 and 3 were never computed: nothing written
    assert not out_h.any()
    store.add("tail", torch.tensor([6, 7, 8]), h2[6:], a2[6:])
    store.commit("tail", row)
    assert store.fill(row, out_h, out_a) == 0
    assert torch.equal(out_h, h2) and torch.equal(out_a, a2)


def test_a_state_of_another_prefix_is_never_used():
    store = PrefixStates()
    h, a = states_of([1, 2, 3])
    store.add("r", torch.arange(3), h, a)
    store.commit("r", [1, 2, 3])
    out = torch.zeros(3, 3, dtype=torch.float64)
    assert (
        store.fill([1, 4, 3], out, out.clone()) == 2
    )  # the same token 3 at position 2, another prefix
    store.clear()
    assert len(store) == 0 and store.fill([1, 2, 3], out, out.clone()) == 3


def test_kept_states_are_copies_not_the_engines_buffer():
    store = PrefixStates()
    buffer = torch.ones(2, 3)
    store.add("r", torch.arange(2), buffer, buffer)
    buffer.zero_()  # the engine's next step reuses its output buffer
    store.commit("r", [4, 5])
    out = torch.zeros(2, 3)
    store.fill([4, 5], out, out.clone())
    assert torch.equal(out, torch.ones(2, 3))
