"""--chat-template: families and files, the one error for a target without a template, the fingerprint,
and records that begin with an assistant turn."""

import hashlib
import json
import random
from pathlib import Path

import pytest

from spec_cli.data import chat_templates, records
from spec_cli.data.template import encode_record, special_token_strings
from spec_cli.data.tokenize import tokenize_data
from spec_cli.errors import ConfigError, TargetError
from spec_cli.targets.loading import tokenizer_fingerprint
from tests import tiny
from tests.conftest import write_jsonl


def base_tokenizer(family: str = "gemma"):
    """A family's tiny tokenizer (its control tokens are in the vocabulary) without a chat template, as a
    base model ships."""
    tokenizer = tiny.build_tokenizer(family)
    tokenizer.chat_template = None
    return tokenizer


def with_template(tokenizer, value):
    return chat_templates.apply(tokenizer, chat_templates.resolve(value))


def supervised_runs(tokenizer, ids, mask) -> list[str]:
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_resolve_families_files_and_bad_values(tmp_path):
    gemma = chat_templates.resolve("gemma")
    assert gemma.source == "family gemma" and gemma.text == chat_templates.FAMILIES["gemma"]["text"]
    assert gemma.sha256 == hashlib.sha256(gemma.text.encode()).hexdigest()
    assert chat_templates.resolve("ChatML").source == "family chatml"
    assert chat_templates.resolve(None) is None

    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    from_file = chat_templates.resolve(str(jinja))
    assert from_file.source == str(jinja.resolve()) and from_file.text == jinja.read_text()
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": jinja.read_text(), "eos_token": "x"}))
    assert chat_templates.resolve(str(config)).text == jinja.read_text()

    with pytest.raises(ConfigError, match="neither a file nor a known template family") as caught:
        chat_templates.resolve("vicuna")
    assert "chatml" in caught.value.hint and "gemma" in caught.value.hint
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        chat_templates.resolve(str(broken))
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no `chat_template`"):
        chat_templates.resolve(str(tmp_path / "empty.json"))


def test_a_target_without_a_template_fails_once_naming_the_option(tmp_path):
    rng = random.Random(0)
    data = write_jsonl(tmp_path / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(20)])
    tokenizer = base_tokenizer()
    with pytest.raises(TargetError, match="has no chat template") as caught:
        tokenize_data(data, tokenizer, tokenizer_fingerprint(tokenizer), use_cache=False)
    assert "--chat-template" in caught.value.hint and "gemma" in caught.value.hint
    # plain-text data needs no template
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": tiny.random_text(rng)} for _ in range(5)])
    assert (
        len(tokenize_data(text, tokenizer, tokenizer_fingerprint(tokenizer), use_cache=False)) == 5
    )
    # chat records hidden among text ones (the data's columns do not say so) meet the same error
    mixed = write_jsonl(
        tmp_path / "mixed.jsonl",
        [{"text": tiny.random_text(rng)} for _ in range(1200)]
        + [
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "ok"},
                ]
            }
        ],
    )
    with pytest.raises(TargetError, match="has no chat template"):
        tokenize_data(mixed, tokenizer, tokenizer_fingerprint(tokenizer), use_cache=False)


def test_a_family_and_a_file_render_the_conversations_and_enter_the_fingerprint(tmp_path):
    rng = random.Random(1)
    bare = base_tokenizer()
    family = with_template(base_tokenizer(), "gemma")
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "the code"},
        {"role": "user", "content": "and"},
        {"role": "assistant", "content": "it is 42"},
    ]
    ids, mask = encode_record(family, {"messages": messages}, 512, special_token_strings(family))
    assert supervised_runs(family, ids, mask) == ["the code<end_of_turn>", "it is 42<end_of_turn>"]
    assert family.decode(ids).startswith("<bos><start_of_turn>user\nhi there<end_of_turn>")

    same_text = tmp_path / "gemma.jinja"
    same_text.write_text(chat_templates.FAMILIES["gemma"]["text"])
    other = tmp_path / "other.jinja"
    other.write_text(chat_templates.FAMILIES["gemma"]["text"].replace("'\\n\\n'", "'\\n'"))
    prints = {
        "none": tokenizer_fingerprint(bare),
        "family": tokenizer_fingerprint(family),
        "same file": tokenizer_fingerprint(with_template(base_tokenizer(), str(same_text))),
        "other file": tokenizer_fingerprint(with_template(base_tokenizer(), str(other))),
        "chatml": tokenizer_fingerprint(with_template(base_tokenizer(), "chatml")),
    }
    assert (
        prints["family"] == prints["same file"]
    )  # the template's text is what counts, not its name
    assert len({prints[k] for k in ("none", "family", "other file", "chatml")}) == 4

    # the tokenised data of two templates differ, and their caches are kept apart
    data = write_jsonl(tmp_path / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(10)])
    a = tokenize_data(data, family, prints["family"])
    chatml = with_template(base_tokenizer(), "chatml")
    b = tokenize_data(data, chatml, prints["chatml"])
    assert not b.metadata["cache_hit"] and a.input_ids.numel() != b.input_ids.numel()


def test_the_chatml_family_on_a_tokenizer_without_its_tokens_warns(capsys):
    with_template(
        base_tokenizer("gemma"), "chatml"
    )  # <|im_start|> is not a token of the gemma tokenizer
    assert "splits into several ordinary tokens" in " ".join(capsys.readouterr().err.split())
    with_template(base_tokenizer("gemma"), "gemma")
    assert "splits" not in capsys.readouterr().err


def test_records_that_begin_with_an_assistant_turn_have_their_own_skip_reason(tmp_path):
    gemma = with_template(base_tokenizer(), "gemma")  # roles must alternate from `user`
    chatml = with_template(base_tokenizer("chatml"), "chatml")  # takes any order
    first = {
        "conversations": [
            {"from": "gpt", "value": "hello, how can I help"},
            {"from": "human", "value": "write code"},
            {"from": "gpt", "value": "ok"},
        ]
    }
    after_system = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
        ]
    }
    two_users = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"},
        ]
    }
    for record in (first, after_system):
        assert (
            encode_record(gemma, record, 512, special_token_strings(gemma))
            == records.ASSISTANT_FIRST
        )
        ids, mask = encode_record(chatml, record, 512, special_token_strings(chatml))
        assert mask.any()
    assert encode_record(gemma, two_users, 512, special_token_strings(gemma)) == records.TEMPLATE

    rng = random.Random(2)
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [tiny.random_sharegpt(rng) for _ in range(6)] + [first] * 3 + [two_users] * 2,
    )
    out = tokenize_data(data, gemma, tokenizer_fingerprint(gemma), use_cache=False)
    assert len(out) == 6
    assert out.metadata["skipped"] == {records.ASSISTANT_FIRST: 3, records.TEMPLATE: 2}


def test_a_mismatch_names_the_template_it_was_made_with():
    tokenizer = with_template(base_tokenizer(), "chatml")
    made_with_gemma = chat_templates.identity(
        with_template(base_tokenizer(), "gemma"), chat_templates.resolve("gemma")
    )
    message, hint = chat_templates.mismatch(
        made_with_gemma, tokenizer, chat_templates.resolve("chatml"), "the vocab map v.safetensors"
    )
    assert "the vocab map v.safetensors was made with the chat template of family gemma" in message
    assert "family chatml" in message and hint.startswith("pass --chat-template gemma")
    bare = base_tokenizer()
    message, hint = chat_templates.mismatch(made_with_gemma, bare, None, "the cache")
    assert "renders conversations with no chat template" in message
    own = chat_templates.identity(tiny.build_tokenizer("gemma"), None)  # the target's own template
    assert chat_templates.mismatch(own, tokenizer, None, "x")[1].startswith("drop --chat-template")
    assert (
        chat_templates.mismatch(
            made_with_gemma, with_template(base_tokenizer(), "gemma"), None, "x"
        )
        is None
    )
    assert (
        chat_templates.mismatch({}, tokenizer, None, "an old artifact") is None
    )  # nothing recorded


def test_family_end_of_turn_tokens_stop_generation():
    gemma = with_template(base_tokenizer(), "gemma")
    assert chat_templates.end_of_turn_ids(gemma, chat_templates.resolve("gemma")) == {
        gemma.convert_tokens_to_ids("<end_of_turn>")
    }
    assert chat_templates.end_of_turn_ids(gemma, None) == frozenset()
    # not a single token of this tokenizer: nothing to stop at
    assert chat_templates.end_of_turn_ids(gemma, chat_templates.resolve("chatml")) == frozenset()


@pytest.mark.parametrize("family", list(tiny.TEMPLATES))
def test_a_template_files_end_of_turn_is_read_off_the_template(family, tmp_path):
    """A Jinja file declares no end-of-turn: the special token it writes right after an answer is the one
    (before, a base model with --chat-template FILE generated past its turn in eval and regenerate)."""
    path = tmp_path / "chat.jinja"
    path.write_text(tiny.TEMPLATES[family][0])
    tokenizer = base_tokenizer(family)
    assert chat_templates.end_of_turn_ids(tokenizer, chat_templates.resolve(str(path))) == {
        tokenizer.convert_tokens_to_ids(tiny.TEMPLATES[family][4])
    }


def test_the_shipped_gemma3_file_ends_turns_as_the_family_does(tmp_path):
    gemma = base_tokenizer("gemma")
    shipped = chat_templates.resolve(
        str(Path(__file__).resolve().parents[2] / "examples" / "gemma3_chat.jinja")
    )
    family = chat_templates.resolve("gemma")
    assert chat_templates.end_of_turn_ids(gemma, shipped) == chat_templates.end_of_turn_ids(
        gemma, family
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "hello\n"},
        {"role": "user", "content": "more"},
    ]
    render = [
        gemma.apply_chat_template(
            messages, chat_template=t.text, tokenize=False, add_generation_prompt=True
        )
        for t in (shipped, family)
    ]
    assert render[0] == render[1]  # the same turns as the family template
    # a template that closes answers with plain text has no end-of-turn token to stop at
    plain = tmp_path / "plain.jinja"
    plain.write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    assert chat_templates.end_of_turn_ids(gemma, chat_templates.resolve(str(plain))) == frozenset()
