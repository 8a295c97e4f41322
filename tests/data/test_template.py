"""Loss masks derived from the chat template: the supervised tokens decode to exactly the assistant
texts plus their end-of-turn token, for every template family."""

import random

import numpy as np
import pytest

from spec_cli.data import records
from spec_cli.data.template import encode_record, special_token_strings
from tests import tiny


def supervised_runs(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decode each maximal run of supervised tokens."""
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [
        tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for run in runs
    ]


def conversation(rng: random.Random, turns: int, system: bool) -> list[dict]:
    messages = [{"role": "system", "content": tiny.random_text(rng)}] if system else []
    for _ in range(turns):
        messages.append({"role": "user", "content": tiny.random_text(rng)})
        messages.append({"role": "assistant", "content": tiny.random_text(rng)})
    return messages


@pytest.fixture(scope="module")
def tokenizers():
    return {family: tiny.build_tokenizer(family) for family in tiny.TEMPLATES}


@pytest.mark.parametrize("family", list(tiny.TEMPLATES))
@pytest.mark.parametrize("system", [False, True])
def test_supervised_tokens_are_exactly_the_assistant_turns(tokenizers, family, system):
    tokenizer = tokenizers[family]
    eot = tiny.TEMPLATES[family][4]
    specials = special_token_strings(tokenizer)
    rng = random.Random(hash((family, system)) % 1000)
    for _ in range(15):
        messages = conversation(rng, rng.randint(1, 4), system)
        out = encode_record(tokenizer, {"messages": messages}, 4096, specials)
        if family == "mistral" and system:  # that template refuses system turns
            assert out == records.TEMPLATE
            continue
        ids, mask = out
        expected = [m["content"] + eot for m in messages if m["role"] == "assistant"]
        assert supervised_runs(tokenizer, ids, mask) == expected
        # and the ids are the template's own tokenisation of the conversation
        reference = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        assert ids.tolist() == list(reference)


@pytest.mark.parametrize("family", ["llama3", "gemma"])
def test_templates_that_trim_content_supervise_the_trimmed_text(tokenizers, family):
    tokenizer = tokenizers[family]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "  the code  \n"},
    ]
    ids, mask = encode_record(
        tokenizer, {"messages": messages}, 512, special_token_strings(tokenizer)
    )
    assert supervised_runs(tokenizer, ids, mask) == ["the code" + tiny.TEMPLATES[family][4]]


@pytest.mark.parametrize("family", list(tiny.TEMPLATES))
def test_an_answer_cut_at_the_length_limit_does_not_supervise_its_end_of_turn(tokenizers, family):
    """`spec regenerate` marks an answer the length limit cut with finish_reason "length": the model never
    emitted the end-of-turn token the template closes it with, so only its text is supervised."""
    tokenizer = tokenizers[family]
    eot = tiny.TEMPLATES[family][4]
    specials = special_token_strings(tokenizer)
    rng = random.Random(5)
    messages = conversation(rng, 3, system=False)
    messages[1]["finish_reason"] = (
        "stop"  # finished answers supervise their end-of-turn token as before
    )
    plain = encode_record(tokenizer, {"messages": [dict(m) for m in messages]}, 4096, specials)
    messages[-1]["finish_reason"] = "length"
    ids, mask = encode_record(tokenizer, {"messages": messages}, 4096, specials)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert supervised_runs(tokenizer, ids, mask) == [answers[0] + eot, answers[1] + eot, answers[2]]
    assert ids.tolist() == plain[0].tolist()  # the same tokens; one supervised token fewer
    assert int(plain[1].sum()) - int(mask.sum()) == 1
    # a cut in the middle of a conversation too (each answer is handled on its own)
    messages[-1].pop("finish_reason")
    messages[3]["finish_reason"] = "length"
    ids, mask = encode_record(tokenizer, {"messages": messages}, 4096, specials)
    assert supervised_runs(tokenizer, ids, mask) == [answers[0] + eot, answers[1], answers[2] + eot]


def test_think_block_scaffolding_is_not_supervised(tokenizers):
    tokenizer = tokenizers["qwen3-think"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer"}]
    ids, mask = encode_record(
        tokenizer, {"messages": messages}, 512, special_token_strings(tokenizer)
    )
    supervised = tokenizer.decode(ids[mask.astype(bool)].tolist())
    assert "think" not in supervised
    assert supervised == "the answer<|im_end|>"


def test_truncation_and_skip_reasons(tokenizers):
    tokenizer = tokenizers["chatml"]
    specials = special_token_strings(tokenizer)
    long_user = " ".join(["water"] * 200)
    rec = {
        "conversations": [
            {"from": "human", "value": long_user},
            {"from": "gpt", "value": "ok then"},
        ]
    }
    assert encode_record(tokenizer, rec, 64, specials) == records.TRUNCATED
    ids, mask = encode_record(tokenizer, rec, 4096, specials)
    assert len(ids) > 64 and mask.any()
    short = {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c d e"}]
    }
    full_ids, full_mask = encode_record(tokenizer, short, 4096, specials)
    ids, mask = encode_record(tokenizer, short, len(full_ids) - 2, specials)
    assert ids.tolist() == full_ids[:-2].tolist() and mask.tolist() == full_mask[:-2].tolist()
    assert encode_record(tokenizer, {"conversations": []}, 64, specials) == records.EMPTY
    assert (
        encode_record(
            tokenizer, {"conversations": [{"from": "human", "value": "hi"}]}, 64, specials
        )
        == records.NO_ASSISTANT
    )
    assert (
        encode_record(
            tokenizer, {"conversations": [{"from": "alien", "value": "hi"}]}, 64, specials
        )
        == records.MALFORMED
    )
    assert encode_record(tokenizer, {"foo": 1}, 64, specials) == records.MALFORMED


def test_plain_text_is_fully_supervised(tokenizers):
    tokenizer = tokenizers["llama3"]
    ids, mask = encode_record(
        tokenizer, {"text": "the model can write code"}, 512, special_token_strings(tokenizer)
    )
    assert mask.all()
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=True) == "the model can write code"


@pytest.mark.parametrize("family", list(tiny.TEMPLATES))
def test_a_huge_record_is_cut_before_tokenizing_with_the_same_tokens(
    tokenizers, family, monkeypatch
):
    """A record far longer than --max-length is cut where its first max_length tokens cannot change:
    the same ids and mask as tokenizing it whole and truncating, while the tokenizer never sees more than
    (max_length + MARGIN) x its longest token's characters per message (a 50 MB record costs what a short
    one does)."""
    from spec_cli.data import template
    from spec_cli.data.template import encode_chat, encode_text, longest_token_chars

    tokenizer, specials = tokenizers[family], special_token_strings(tokenizer := tokenizers[family])
    rng = random.Random(7)
    huge = " ".join(tiny.random_text(rng) for _ in range(3000))  # ~100k+ characters
    cases = {
        "chat": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": huge},
            {"role": "user", "content": huge},
            {"role": "assistant", "content": "fine"},
        ],
        "long question": [
            {"role": "user", "content": huge},
            {"role": "assistant", "content": "fine"},
        ],
    }
    max_length = 64
    budget = (max_length + template.MARGIN) * longest_token_chars(tokenizer)
    assert len(huge) > 4 * budget
    seen = []
    real = tokenizer.apply_chat_template

    def spy(messages, *args, **kwargs):
        seen.append(max(len(m["content"]) for m in messages))
        return real(messages, *args, **kwargs)

    for name, messages in cases.items():
        ids, mask = encode_chat(
            tokenizer, messages, specials
        )  # whole, then truncated: the reference
        monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
        out = encode_record(tokenizer, {"messages": messages}, max_length, specials)
        monkeypatch.undo()
        if not mask[:max_length].any():
            assert out == records.TRUNCATED, name
        else:
            assert (
                out[0].tolist() == ids[:max_length].tolist()
                and out[1].tolist() == mask[:max_length].tolist()
            )
        assert seen and max(seen) <= budget, (name, max(seen), budget)
    ids = encode_text(tokenizer, huge)[0]
    assert (
        encode_record(tokenizer, {"text": huge}, max_length, specials)[0].tolist()
        == ids[:max_length].tolist()
    )
