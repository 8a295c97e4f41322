"""spec regenerate through the real CLI on a tiny target: turn order, determinism, batching, resume after
kill -9, the length mark, skip reasons, the sidecar, and the output as chat data for the other stages."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spec_cli.cli import main
from spec_cli.data.tokenize import tokenize_data
from spec_cli.stages import regenerate as stage
from spec_cli.targets import loading
from tests import tiny
from tests.conftest import signalled_child, wait_for, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def add_end_tokens(target: Path) -> Path:
    """Name 40 more end-of-turn ids (those ending in 3) in the target's generation config. A tiny random
    model almost never picks its one eos, so every answer would be cut at the length limit and no
    conversation would reach its second turn; with these, answers end after a few tokens or run long."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    ids = [tokenizer.eos_token_id] + [i for i in range(len(tokenizer)) if i % 10 == 3]
    GenerationConfig(eos_token_id=ids, bos_token_id=tokenizer.bos_token_id).save_pretrained(
        str(target)
    )
    return target


@pytest.fixture(scope="module")
def talker(tmp_path_factory, tiny_llama_dir) -> Path:
    target = tmp_path_factory.mktemp("regenerate") / "talker"
    shutil.copytree(tiny_llama_dir, target)
    return add_end_tokens(target)


def multi_turn(rng: random.Random, turns: int, system: bool = False) -> dict:
    messages = [{"role": "system", "content": tiny.random_text(rng)}] if system else []
    for _ in range(turns):
        messages += [
            {"role": "user", "content": tiny.random_text(rng, 3, 12)},
            {"role": "assistant", "content": tiny.random_text(rng)},
        ]
    return {"messages": messages}


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    rng = random.Random(3)
    return write_jsonl(
        tmp_path_factory.mktemp("chats") / "chats.jsonl",
        [multi_turn(rng, rng.randint(1, 3), system=i % 3 == 0) for i in range(24)],
    )


def regenerate(target, data, out, *extra) -> int:
    return main(
        [
            "regenerate",
            "-t",
            str(target),
            "-d",
            str(data),
            "-o",
            str(out),
            "--max-new-tokens",
            "48",
            "--max-length",
            "384",
            "-q",
            *extra,
        ]
    )


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def meta(out: Path) -> dict:
    return json.loads(Path(f"{out}.meta.json").read_text())


@torch.no_grad()
def reference_answer(
    model, tokenizer, messages: list[dict], max_new_tokens: int, eos: frozenset[int]
) -> str:
    """The target's greedy answer by plain `model.generate` on the rendered prompt (batch size 1)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos),
        pad_token_id=tokenizer.pad_token_id,
    )[0, ids.shape[1] :].tolist()
    stop = next((k for k, t in enumerate(out) if t in eos), None)
    return tokenizer.decode(
        out[:stop], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def test_each_turn_is_asked_after_the_targets_own_answer(talker, chats, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out.jsonl"
    assert regenerate(talker, chats, out) == 0
    written, source = read(out), read(chats)
    assert [r["source_index"] for r in written] == list(range(len(source)))
    tokenizer = loading.load_tokenizer(talker)
    model = AutoModelForCausalLM.from_pretrained(str(talker)).eval()
    eos = stage.eos_ids(tokenizer, loading.generation_config(talker))
    second_turns = 0
    for record, original in zip(written, source):
        asked = [m for m in original["messages"] if m["role"] != "assistant"]
        messages = record["messages"]
        # the system and user messages in order, the target's answers in between, nothing of the original's
        kept = [m for m in messages if m["role"] != "assistant"]
        assert kept == asked[: len(kept)]
        assert messages[0]["role"] == original["messages"][0]["role"]  # a system prompt stays first
        assert messages[-1]["role"] == "assistant"
        history = []
        for m in messages:
            if (
                m["role"] == "assistant"
            ):  # each answer is the target's own, after its own earlier answers
                prompt = [{"role": h["role"], "content": h["content"]} for h in history]
                assert m["content"] == reference_answer(model, tokenizer, prompt, 48, eos)
                second_turns += sum(h["role"] == "assistant" for h in history) > 0
            history.append(m)
    assert second_turns >= 3, "too few second turns to show the order"


def test_consecutive_user_messages_are_answered_once_and_leading_answers_dropped(talker, tmp_path):
    data = write_jsonl(
        tmp_path / "odd.jsonl",
        [
            {
                "conversations": [
                    {"from": "gpt", "value": "hello, how can I help"},
                    {"from": "human", "value": "the code"},
                    {"from": "human", "value": "and the model"},
                    {"from": "gpt", "value": "ok"},
                ]
            }
        ],
    )
    out = tmp_path / "out.jsonl"
    assert regenerate(talker, data, out) == 0
    [record] = read(out)
    assert [m["role"] for m in record["messages"]] == ["user", "user", "assistant"]
    assert [m["content"] for m in record["messages"][:2]] == ["the code", "and the model"]
    assert meta(out)["counts"]["leading_assistant_dropped"] == 1


def test_greedy_runs_are_identical_and_sampling_is_reproducible_by_seed(talker, chats, tmp_path):
    files = {}
    for name, extra in [
        ("greedy", []),
        ("greedy2", []),
        ("s1", ["--temperature", "0.8", "--seed", "1"]),
        ("s1again", ["--temperature", "0.8", "--seed", "1"]),
        ("s2", ["--temperature", "0.8", "--seed", "2"]),
        ("s1top", ["--temperature", "0.8", "--seed", "1", "--top-p", "0.5"]),
    ]:
        out = tmp_path / f"{name}.jsonl"
        assert regenerate(talker, chats, out, "--max-samples", "10", *extra) == 0
        files[name] = out.read_bytes()
    assert files["greedy"] == files["greedy2"]
    assert files["s1"] == files["s1again"]
    assert len({files["greedy"], files["s1"], files["s2"], files["s1top"]}) == 4


@pytest.mark.parametrize(
    "sampling", [[], ["--temperature", "1.0", "--seed", "4"]], ids=["greedy", "sampled"]
)
def test_batched_answers_equal_unbatched_ones(talker, chats, tmp_path, sampling):
    one, eight = tmp_path / "one.jsonl", tmp_path / "eight.jsonl"
    assert regenerate(talker, chats, one, "--batch-size", "1", *sampling) == 0
    assert (
        regenerate(talker, chats, eight, "--batch-size", "8", "--chunk-size", "5", *sampling) == 0
    )
    assert one.read_bytes() == eight.read_bytes()


def test_an_answer_cut_at_the_length_limit_is_marked_and_ends_its_conversation(
    talker, chats, tmp_path
):
    out = tmp_path / "out.jsonl"
    assert regenerate(talker, chats, out, "--max-new-tokens", "6") == 0
    written, cut = read(out), 0
    for record in written:
        answers = [m for m in record["messages"] if m["role"] == "assistant"]
        assert all(m["finish_reason"] in ("stop", "length") for m in answers)
        assert all(m["finish_reason"] == "stop" for m in answers[:-1])  # only the last can be cut
        cut += answers[-1]["finish_reason"] == "length"
    counts = meta(out)["counts"]
    assert 0 < cut == counts["answers_cut_by_length"]
    assert counts["turns_answered"] == sum(
        m["role"] == "assistant" for r in written for m in r["messages"]
    )
    # --max-length ends a conversation whose next prompt would not fit
    short = tmp_path / "short.jsonl"
    assert regenerate(talker, chats, short, "--max-length", "60") == 0
    ended = meta(short)["counts"]["conversations_ended_early"]
    assert ended.get("next prompt longer than --max-length", 0) > 0
    for record in read(short):
        assert len(stage.prompt_ids(loading.load_tokenizer(talker), record["messages"][:-1])) < 60


def test_output_is_chat_data_for_the_other_stages_and_the_sidecar_says_how_it_was_made(
    talker, tmp_path
):
    rng = random.Random(8)
    good = [multi_turn(rng, 2) for _ in range(6)]
    bad = [
        {"text": "plain text"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
        {"messages": []},
        {"conversations": [{"from": "alien", "value": "x"}]},
        {"messages": [{"role": "user", "content": " ".join(["water"] * 400)}]},
        {"messages": [{"role": "user", "content": "only a question, no answer"}]},
    ]
    data = write_jsonl(tmp_path / "mixed.jsonl", good[:3] + bad + good[3:])
    out = tmp_path / "out.jsonl"
    assert regenerate(talker, data, out, "--max-new-tokens", "8") == 0
    written = read(out)
    assert [r["source_index"] for r in written] == [
        0,
        1,
        2,
        8,
        9,
        10,
        11,
    ]  # input order, usable only
    m = meta(out)
    assert m["counts"]["skipped"] == {
        "empty": 1,
        "malformed": 1,
        "no user turn": 1,
        "plain text (no turns to answer)": 1,
        "prompt longer than --max-length": 1,
    }
    assert m["counts"]["records_read"] == 12 and m["counts"]["records_written"] == 7
    assert m["kind"] == "regenerated_chat_data" and m["engine"] == {"name": "transformers"}
    assert m["target_fingerprint"] == loading.target_fingerprint(talker)
    assert m["tokenizer_fingerprint"] == loading.tokenizer_fingerprint(
        loading.load_tokenizer(talker)
    )
    assert m["data_sha256"] == stage.sha256_path(data) and m["output_sha256"] == stage.sha256_path(
        out
    )
    assert m["settings"]["temperature"] == 0.0 and m["settings"]["max_new_tokens"] == 8
    assert m["settings"]["max_length"] == 384 and m["counts"]["tokens_generated"] > 0
    assert m["tokens_per_second"] > 0 and m["spec_cli_version"] and m["chat_template_sha256"]
    # how the tokens/s were measured: the thread count chosen for the run, and how busy the machine was
    assert m["threads"] >= 1 and m["threads_reason"] and {"too_busy", "cpu_share"} <= set(m["busy"])
    assert not Path(f"{out}.parts").exists()

    tokenizer = loading.load_tokenizer(talker)
    tokens = tokenize_data(out, tokenizer, loading.tokenizer_fingerprint(tokenizer), 2048)
    assert len(tokens) == len(written) and tokens.metadata["skipped"] == {}
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    for i, record in enumerate(written):
        start, end = int(tokens.offsets[i]), int(tokens.offsets[i + 1])
        ids, mask = tokens.input_ids[start:end], tokens.loss_mask[start:end].bool()
        supervised_eots = int((ids[mask] == eot).sum())
        finished = sum(m.get("finish_reason") == "stop" for m in record["messages"])
        assert supervised_eots == finished  # a cut answer's end-of-turn token is not supervised


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_kill_9_or_sigterm_then_rerun_gives_the_identical_file(
    talker, chats, tmp_path, capsys, sig
):
    """SIGKILL keeps the finished chunks; a scheduler's SIGTERM does as Ctrl-C does: the chunk in flight is
    abandoned, the finished ones kept, one line, exit 143. The rerun ends with the straight run's bytes."""
    straight = tmp_path / "straight.jsonl"
    assert regenerate(talker, chats, straight, "--chunk-size", "4") == 0

    out = tmp_path / "resumed.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "spec_cli.cli",
        "regenerate",
        "-t",
        str(talker),
        "-d",
        str(chats),
        "-o",
        str(out),
        "--max-new-tokens",
        "48",
        "--max-length",
        "384",
        "--chunk-size",
        "4",
    ]
    env = {**os.environ, "SPEC_TEST_CHUNK_DELAY": "1", "OMP_NUM_THREADS": "1"}
    with signalled_child(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as proc:
        parts = Path(f"{out}.parts")
        wait_for(parts / "part-00001.json", proc, "regenerate", 120)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith("stopped (SIGTERM); finished work is kept")
    done = sorted(p.name for p in parts.glob("part-*.json"))
    assert 2 <= len(done) < 6 and not out.exists()

    capsys.readouterr()
    assert main(cmd[3:]) == 0  # the rerun, in this process (the stopped run was the other process)
    assert f"reusing {len(done)} finished chunk(s)" in capsys.readouterr().out
    assert out.read_bytes() == straight.read_bytes()
    assert not parts.exists() and not list(tmp_path.glob(".*tmp"))
    assert (
        meta(out)["parts_reused"] == len(done) and meta(out)["counts"] == meta(straight)["counts"]
    )


@pytest.mark.slow
def test_a_run_with_stdout_to_a_file_logs_its_progress_in_lines(talker, chats, tmp_path):
    """`spec regenerate ... > log` (Slurm, nohup): the work said before it starts, then plain
    flushed lines (here at every advance and every second between: the interval is set to 0)
    counting up to every user turn, and the end line; no bar, no carriage returns or ANSI codes."""
    out, log = tmp_path / "out.jsonl", tmp_path / "log"
    script = (
        "import sys; import spec_cli.console as c; c.LINE_INTERVAL_S = 0; "
        "from spec_cli.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = [
        "regenerate",
        "-t",
        str(talker),
        "-d",
        str(chats),
        "-o",
        str(out),
        "--max-new-tokens",
        "48",
        "--max-length",
        "384",
        "--chunk-size",
        "8",
    ]
    with open(log, "w") as f:
        done = subprocess.run(
            [sys.executable, "-c", script, *args],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert "\x1b" not in text and "\r" not in text
    # one answer per user turn (a conversation that ends early counts its unanswered turns as done)
    turns = sum(m["role"] == "user" for record in read(chats) for m in record["messages"])
    lines = text.splitlines()
    assert (
        f"regenerate: 24 records in 3 chunk(s) of 8; {turns} turns to answer, up to 48 new "
        "tokens each"
    ) in lines
    start = lines.index(f"regenerating: {turns} turns to do")
    progress = [line for line in lines[start + 1 :] if line.startswith("regenerating: ")]
    said = [
        re.fullmatch(
            rf"regenerating: (\d+)/{turns} turns, [\d.]+k? tokens/s, \S+ so far, "
            r"\S+ left",
            line,
        )
        for line in progress[:-1]
    ]
    assert said and all(said), progress
    counts = [int(m.group(1)) for m in said]
    assert counts == sorted(counts) and counts[-1] < turns  # (the end has its own line)
    assert re.fullmatch(
        rf"regenerating: {turns}/{turns} turns, [\d.]+k? tokens/s, done in \S+", progress[-1]
    )
    assert len(read(out)) == 24


def test_other_settings_are_refused_unless_overwrite(talker, chats, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert regenerate(talker, chats, out, "--max-samples", "4") == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert (
        main(
            [
                "regenerate",
                "-t",
                str(talker),
                "-d",
                str(chats),
                "-o",
                str(out),
                "--max-new-tokens",
                "48",
                "--max-length",
                "384",
                "--max-samples",
                "4",
            ]
        )
        == 0
    )
    assert "already complete" in capsys.readouterr().out
    assert regenerate(talker, chats, out, "--max-samples", "4", "--temperature", "0.5") == 1
    err = capsys.readouterr().err
    assert "other inputs or settings" in err and "temperature" in err and "--overwrite" in err
    assert out.read_bytes() == before
    # an unfinished run with other settings is refused too, and --overwrite starts over
    parts = Path(f"{out}.parts")
    parts.mkdir()
    (parts / "state.json").write_text(json.dumps({"identity": {"temperature": 9}}))
    assert regenerate(talker, chats, out, "--max-samples", "4") == 1
    assert "unfinished regenerate run" in capsys.readouterr().err
    assert regenerate(talker, chats, out, "--max-samples", "4", "--overwrite") == 0
    assert out.read_bytes() == before and not parts.exists()


def test_data_without_anything_to_answer_is_a_clear_error(talker, tmp_path, capsys, monkeypatch):
    data = write_jsonl(
        tmp_path / "none.jsonl",
        [{"text": "a"}, {"messages": [{"role": "assistant", "content": "b"}]}],
    )
    assert regenerate(talker, data, tmp_path / "out.jsonl") == 1
    err = capsys.readouterr().err
    assert "has no records to answer" in err and "no user turn: 1" in err and "user turns" in err
    assert not (tmp_path / "out.jsonl").exists()

    from spec_cli.engine import vllm

    monkeypatch.setattr(vllm, "available", lambda: False)
    assert regenerate(talker, data, tmp_path / "out.jsonl", "--engine", "vllm") == 1
    err = capsys.readouterr().err
    assert "needs vLLM, which is not installed" in err and "pip install -e '.[vllm]'" in err


def test_features_mistakes_are_one_line_each_before_anything_runs(
    talker, chats, tmp_path, capsys, monkeypatch
):
    from spec_cli.engine import vllm

    monkeypatch.setattr(
        vllm, "require", lambda what: None
    )  # the checks come before vLLM starts: none is needed
    out = tmp_path / "out.jsonl"
    assert (
        regenerate(talker, chats, out, "--features", str(tmp_path / "c"), "--vocab-map", "v") == 1
    )
    assert (
        "--features keeps the states vLLM computes while it answers (--engine vllm)"
        in capsys.readouterr().err
    )
    assert (
        regenerate(talker, chats, out, "--engine", "vllm", "--features", str(tmp_path / "c")) == 1
    )
    assert "pass --vocab-map PATH" in " ".join(capsys.readouterr().err.split())
    (tmp_path / "file").write_text("x")
    assert (
        regenerate(
            talker,
            chats,
            out,
            "--engine",
            "vllm",
            "--features",
            str(tmp_path / "file"),
            "--vocab-map",
            "v",
        )
        == 1
    )
    assert "is a file spec_cli did not write; a feature cache is a folder" in " ".join(
        capsys.readouterr().err.split()
    )
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    assert (
        regenerate(
            talker,
            chats,
            out,
            "--engine",
            "vllm",
            "--features",
            str(tmp_path / "mine"),
            "--vocab-map",
            "v",
        )
        == 1
    )
    assert (
        "is a folder holding files spec_cli did not write, not a feature cache; it is never replaced"
        in " ".join(capsys.readouterr().err.split())
    )
    damaged = tmp_path / "vocab.safetensors"
    damaged.write_bytes(b"not a vocab map")
    assert (
        regenerate(
            talker,
            chats,
            out,
            "--engine",
            "vllm",
            "--features",
            str(tmp_path / "c"),
            "--vocab-map",
            str(damaged),
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "vocab.safetensors" in err and "internal error" not in err
    assert not out.exists() and not (tmp_path / "out.jsonl.parts").exists()


def test_length_batches_respect_both_bounds():
    lengths, budgets = [5, 50, 6, 7, 48, 5], [10, 10, 10, 10, 10, 10]
    batches = stage.length_batches(lengths, budgets, batch_tokens=68, batch_size=None)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for batch in batches:
        width = max(lengths[i] for i in batch) + max(budgets[i] for i in batch)
        assert len(batch) == 1 or len(batch) * width <= 68
    assert batches[0] == [0, 5, 2, 3]  # length-sorted: the short ones together
    assert all(len(b) <= 2 for b in stage.length_batches(lengths, budgets, 10**6, batch_size=2))
