"""Evaluation prompts: MT-bench and chat files -> conversations of user turns, asked through the template."""

import pytest

from spec_cli.errors import DataError
from spec_cli.eval import prompts
from tests.conftest import write_jsonl


@pytest.mark.real
def test_mt_bench_is_80_two_turn_questions_in_8_categories(real_home):
    convs = prompts.load_conversations("mt-bench")
    assert len(convs) == 80 and all(len(c.turns) == 2 for c in convs)
    assert len({c.category for c in convs}) == 8
    few = prompts.load_conversations("mt-bench", num_prompts=8)  # round-robin: one per category
    assert len({c.category for c in few}) == 8


def test_chat_files_give_their_user_turns(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"turns": ["first?", "second?"], "category": "a"},
            {
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "hello"},
                    {"from": "human", "value": "more"},
                ]
            },
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
                "category": "b",
            },
            {"prompt": "just one", "category": "a"},
            {"text": ""},
        ],
    )
    convs = prompts.load_conversations(str(path))
    assert [c.turns for c in convs] == [
        ["first?", "second?"],
        ["hi", "more"],
        ["parts"],
        ["just one"],
    ]
    assert convs[1].system == "Be brief." and convs[0].category == "a" and convs[1].category is None
    picked = prompts.load_conversations(
        str(path), num_prompts=3
    )  # a, None, b first; kept in file order
    assert [c.turns[0] for c in picked] == ["first?", "hi", "parts"]
    conv = convs[1]
    conv.answers.append("ANSWER")
    assert conv.messages(1) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ANSWER"},
        {"role": "user", "content": "more"},
    ]
    with pytest.raises(DataError, match="no user turns"):
        prompts.load_conversations(str(write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])))


def test_prompt_ids_use_the_chat_template(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))  # llama3 template
    conv = prompts.Conversation(id="0", turns=["what is code", "and a model"], answers=["a draft"])
    ids = prompts.prompt_ids(tokenizer, conv, 1)
    text = tokenizer.decode(ids)
    assert text.startswith("<|begin_of_text|>") and text.count("<|begin_of_text|>") == 1
    assert (
        text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        and "a draft<|eot_id|>" in text
    )
    assert text.index("what is code") < text.index("a draft") < text.index("and a model")
