"""Chat records of every accepted shape normalised to messages or plain text, and each skip reason."""

import json

import pytest

from spec_cli.data import records
from spec_cli.errors import DataError


def test_roles_are_normalised():
    kind, messages = records.normalise(
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "Human", "value": "u"},
                {"from": "model", "value": "a"},
                {"from": "user", "value": "u2"},
                {"from": "chatgpt", "value": "a2"},
            ]
        }
    )
    assert kind == "chat"
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    kind, messages = records.normalise(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}],
                },
                {"role": "assistant", "content": "hi"},
            ]
        }
    )
    assert messages[0]["content"] == "hello"


def test_sharegpt_openai_and_plain_text_shapes():
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
        ]
    }
    assert records.normalise(sharegpt) == ("chat", chat)
    assert records.normalise({"messages": chat}) == ("chat", chat)
    # a column another file filled with None (parquet / datasets) does not hide the one that is there
    assert records.normalise({"conversations": None, "messages": chat, "text": None}) == (
        "chat",
        chat,
    )
    # either key spelling inside either container
    assert records.normalise(
        {"messages": [{"from": "user", "value": "hi"}, {"role": "assistant", "value": "hello"}]}
    ) == ("chat", chat[1:])
    assert records.normalise({"text": "  plain text\n"}) == (
        "text",
        "  plain text\n",
    )  # kept as written


def test_finish_reason_is_kept_on_assistant_turns_only():
    kind, messages = records.normalise(
        {
            "messages": [
                {"role": "user", "content": "q", "finish_reason": "length"},
                {"role": "assistant", "content": "cut", "finish_reason": "length"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "done", "finish_reason": "stop"},
                {"role": "user", "content": "q3"},
                {"role": "assistant", "content": "odd", "finish_reason": "tool_calls"},
            ]
        }
    )
    assert [m.get("finish_reason") for m in messages] == [None, "length", None, "stop", None, None]


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"text": 3}, records.MALFORMED),
        ({"text": " \n"}, records.EMPTY),
        ({"prompt": "no known key"}, records.MALFORMED),
        ({"conversations": "not a list"}, records.MALFORMED),
        ({"conversations": []}, records.EMPTY),
        ({"messages": ["not a dict"]}, records.MALFORMED),
        (
            {
                "messages": [
                    {"role": "narrator", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ]
            },
            records.MALFORMED,
        ),
        (
            {"messages": [{"content": "no role"}, {"role": "assistant", "content": "y"}]},
            records.MALFORMED,
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                    {"role": "assistant", "content": "y"},
                ]
            },
            records.IMAGES,
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": "cat.png"},
                            {"type": "text", "text": "what is it?"},
                        ],
                    },
                    {"role": "assistant", "content": "a cat"},
                ]
            },
            records.IMAGES,
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "<image>\nwhat is it?"},
                    {"from": "gpt", "value": "a cat"},
                ],
                "image": "cat.png",
            },
            records.IMAGES,
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "audio", "audio": "x"}]},
                    {"role": "assistant", "content": "y"},
                ]
            },
            records.MALFORMED,
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": None},
                    {"role": "assistant", "content": "y"},
                ]
            },
            records.MALFORMED,
        ),
        (
            {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]},
            records.EMPTY,
        ),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
            records.NO_ASSISTANT,
        ),
    ],
)
def test_skip_reasons(record, reason):
    assert records.normalise(record) == ("skip", reason)


def test_prompts_without_an_answer_are_kept_for_regenerate():
    record = {"conversations": [{"from": "human", "value": "tell me"}]}
    assert records.normalise(record, require_assistant=False) == (
        "chat",
        [{"role": "user", "content": "tell me"}],
    )
    assert records.normalise(record) == ("skip", records.NO_ASSISTANT)


def test_a_saved_dataset_dict_reads_its_train_split(tmp_path):
    import datasets

    rows = {"train": [{"text": "a"}, {"text": "b"}], "test": [{"text": "c"}]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in rows.items()}).save_to_disk(
        str(tmp_path / "saved")
    )
    assert records.load_records(tmp_path / "saved")["text"] == ["a", "b"]
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows["test"])}).save_to_disk(
        str(tmp_path / "one_split")
    )
    assert records.load_records(tmp_path / "one_split")["text"] == [
        "c"
    ]  # no train split: the first one
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported data file notes.txt"):
        records.load_records(tmp_path / "notes.txt")


# ----------------------------------------------------------------------------- JSON lines beyond the first chunk


def _turns(text: str, value=None) -> list[dict]:
    return [
        {"from": "human", "value": text},
        {"from": "gpt", "value": text if value is None else value},
    ]


@pytest.fixture(scope="module")
def past_the_first_chunk(tmp_path_factory) -> dict:
    """ShareGPT records filling datasets' first 10 MB chunk, then records with what that chunk lacks: a
    top-level `id`, an int-then-float `score`, a turn's `finish_reason`, a `value` given as text parts."""
    path = tmp_path_factory.mktemp("records") / "late.jsonl"
    plain = json.dumps({"conversations": _turns("hello " * 30)}) + "\n"
    n_plain = records.CHUNK // len(plain) + 50
    late = [
        {"id": "late-0", "conversations": _turns("a")},
        {
            "id": "late-1",
            "score": 1,
            "conversations": [
                *_turns("b")[:1],
                {"from": "gpt", "value": "cut", "finish_reason": "length"},
            ],
        },
        {
            "id": "late-2",
            "score": 0.5,
            "conversations": _turns(
                "c", [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]
            ),
        },
    ]
    with open(path, "w") as f:
        f.write(plain * n_plain + "".join(json.dumps(r) + "\n" for r in late))
    return {"path": path, "n_plain": n_plain, "plain": plain}


def test_a_field_first_seen_after_the_first_10_mb_loads(past_the_first_chunk):
    path, n = past_the_first_chunk["path"], past_the_first_chunk["n_plain"]
    assert path.stat().st_size > records.CHUNK
    loaded = records.load_records(path)
    assert len(loaded) == n + 3
    assert loaded[0]["id"] is None and loaded[0]["score"] is None
    assert records.normalise(loaded[0]) == (
        "chat",
        [
            {"role": "user", "content": "hello " * 30},
            {"role": "assistant", "content": "hello " * 30},
        ],
    )
    assert [loaded[i]["id"] for i in range(n, n + 3)] == ["late-0", "late-1", "late-2"]
    assert [loaded[i]["score"] for i in range(n, n + 3)] == [None, 1, 0.5]
    assert records.normalise(loaded[n + 1])[1][-1] == {
        "role": "assistant",
        "content": "cut",
        "finish_reason": "length",
    }
    assert records.normalise(loaded[n + 2])[1][-1] == {"role": "assistant", "content": "cd"}


def test_an_invalid_json_line_is_named_by_number_in_one_line(tmp_path, monkeypatch):
    good = json.dumps({"conversations": _turns("hi")})
    data = tmp_path / "bad.jsonl"
    data.write_text(f"{good}\n{good}\n{good[:-5]}\n{good}\n")
    with pytest.raises(DataError) as caught:
        records.load_records(data)
    column = good.rindex('"hi') + 1  # the cut string's opening quote, counted from 1
    assert caught.value.one_line() == (
        f"{data}: line 3 is not valid JSON (Unterminated string starting at, "
        f"column {column}); fix or remove that line (JSON lines: one JSON object "
        "per line)"
    )
    # read in chunks of a few lines: numbered from the top of the file, not of its chunk
    monkeypatch.setattr(records, "CHUNK", 2 * len(good))
    data.write_text(f"{good}\n" * 7 + "[1, 2]\n" + f"{good}\n")
    with pytest.raises(DataError) as caught:
        records.load_records(data)
    assert caught.value.one_line() == (
        f"{data}: line 8 is a JSON list, not an object; write each record as one "
        "JSON object per line"
    )
