"""Progress off a terminal (a log, Slurm, nohup): plain flushed lines with done/total, the rate and
the time left, at most one per LINE_INTERVAL_S between the start and the end, on a clock the tests
drive."""

import io

import pytest

import spec_cli.console as console_mod
from spec_cli.console import Bar, ProgressLines, duration, info, progress


@pytest.fixture
def clock(monkeypatch):
    """The progress lines' clock, moved by hand; the lines every 30 s of it. The heartbeat thread
    waits 30 real seconds, so it never speaks in a test."""
    now = [1000.0]
    monkeypatch.setattr(console_mod, "_now", lambda: now[0])
    monkeypatch.setattr(console_mod, "LINE_INTERVAL_S", 30.0)
    monkeypatch.delenv("RANK", raising=False)
    return now


def lines(capsys) -> list[str]:
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out  # no ANSI codes, no carriage returns
    return out.splitlines()


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (42.4, "42s"), (294, "4m54s"), (3600, "1h00m"), (7530, "2h05m"), (-3, "0s")],
)
def test_durations_read_as_a_person_says_them(seconds, text):
    assert duration(seconds) == text


def test_off_a_terminal_progress_is_a_start_line_interval_lines_and_an_end_line(clock, capsys):
    with progress("regenerating", 800, unit="turns", rate="tokens") as bar:
        assert isinstance(bar, ProgressLines)
        clock[0] += 10
        bar.advance(40, count=4000)  # 10 s after the start line: too soon for another
        clock[0] += 21
        bar.advance(80, count=8000)  # 31 s: a line
        clock[0] += 14
        bar.advance(80, count=8000)  # 14 s after that line: none
        clock[0] += 25
        bar.tick()  # the heartbeat at 70 s, no advance since 45 s: the time left counts down
        clock[0] += 5
        bar.tick()  # 5 s after that line: none
        clock[0] += 325
        bar.advance(600, count=60000)  # all done at 400 s: the end line says it
    # at 31 s: 120 turns and 12,000 tokens -> 387 tokens/s; 680 turns left at 31/120 s each: 175.7 s
    # at 70 s: 200 turns, 20,000 tokens in 45 s -> 444 tokens/s; 600 x 45/200 = 135 s, less the 25 s
    # since
    assert lines(capsys) == [
        "regenerating: 800 turns to do",
        "regenerating: 120/800 turns, 387 tokens/s, 31s so far, 2m56s left",
        "regenerating: 200/800 turns, 444 tokens/s, 1m10s so far, 1m50s left",
        "regenerating: 800/800 turns, 200 tokens/s, done in 6m40s",  # 80,000 tokens in 400 s
    ]


def test_the_rate_is_of_the_units_without_a_rate_unit_and_no_time_left_without_a_total(
    clock, capsys
):
    with progress("counting", None, unit="records") as bar:
        clock[0] += 40
        bar.advance(100)
        clock[0] += 60
        bar.advance(500)
    assert lines(capsys) == [
        "counting: started",
        "counting: 100 records, 2.5 records/s, 40s so far",
        "counting: 600 records, 6 records/s, 1m40s so far",
        "counting: 600 records, 6 records/s, done in 1m40s",
    ]


def test_before_any_advance_a_line_has_no_rate_and_no_time_left(clock, capsys):
    with progress("precompute", 1_000_000, unit="tokens") as bar:
        clock[0] += 95
        bar.tick()
        clock[0] += 5
        bar.advance(250_000)  # 100 s: a quarter, 5 s after the last line: none
        clock[0] += 25
        bar.tick()
    # 750,000 tokens left at 100/250,000 s each: 300 s, less the 25 s since the advance
    assert lines(capsys)[1:3] == [
        "precompute: 0/1.0M tokens, 1m35s so far",
        "precompute: 250.0k/1.0M tokens, 2500 tokens/s, 2m05s so far, 4m35s left",
    ]


def test_a_resumed_run_counts_its_rate_and_time_left_from_its_own_work(clock, capsys):
    steps = ProgressLines("train", 1000, unit="steps", rate="tokens", completed=500)
    clock[0] += 50
    steps.advance(10, count=5000)  # 10 steps in 50 s: 490 left take 2450 s
    steps.close()
    assert lines(capsys) == [
        "train: 500 steps to do (500 done before)",
        "train: 510/1000 steps, 100 tokens/s, 50s so far, 40m50s left",
        "train: 510/1000 steps, 100 tokens/s, done in 50s",
    ]


def test_an_error_ends_the_lines_without_a_done_line(clock, capsys):
    with pytest.raises(KeyboardInterrupt):
        with progress("eval", 10, unit="turns") as bar:
            clock[0] += 40
            bar.advance(3)
            raise KeyboardInterrupt
    # 3 turns in 40 s: 7 left take 93 s
    assert lines(capsys) == [
        "eval: 10 turns to do",
        "eval: 3/10 turns, 0.075 turns/s, 40s so far, 1m33s left",
    ]
    assert not bar._thread.is_alive()  # the heartbeat ended with it


def test_quiet_and_other_ranks_print_nothing_and_a_terminal_keeps_its_bar(
    clock, capsys, monkeypatch
):
    console_mod.set_quiet(True)
    with progress("eval", 10, unit="turns") as bar:
        bar.advance(10)
    console_mod.set_quiet(False)
    monkeypatch.setenv("RANK", "1")
    with progress("eval", 10, unit="turns") as bar:
        bar.advance(10)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")

    from rich.console import Console

    monkeypatch.setattr(console_mod, "console", Console(file=io.StringIO(), force_terminal=True))
    monkeypatch.setattr(console_mod.sys.stdout, "isatty", lambda: True)
    with progress("eval", 10, unit="turns") as bar:
        assert isinstance(bar, Bar)


def test_a_long_message_stays_one_line_in_a_log(capsys):
    path = "/data/runs/" + "/".join(f"folder{i:02d}" for i in range(20)) + "/model.safetensors"
    info(f"exporting {path} for vLLM")
    # (rich would wrap it at 80 columns)
    assert capsys.readouterr().out == f"exporting {path} for vLLM\n"


def test_train_off_a_terminal_fills_only_the_silences_between_its_step_records(
    clock, capsys, tmp_path
):
    """`spec train` prints a record every --log-every steps; a line of its own comes only when no
    record came for LINE_INTERVAL_S (slow steps before the first record), with the steps' rate and
    the time left, and none at the start or the end (the run's own lines say those)."""
    from spec_cli.trainer.log import TrainLogger

    def record(step: int) -> dict:
        return {
            "split": "train",
            "step": step,
            "loss": 2.0,
            "acc": [0.5],
            "acceptance_length": 1.5,
            "tokens_per_s": 100.0,
            "steps_in_record": 1,
        }

    log = TrainLogger(tmp_path, total_steps=100, start_step=10)
    try:
        clock[0] += 20
        log.step(tokens=1000)  # step 11 at 20 s: too soon
        clock[0] += 20
        log.step(tokens=1000)  # step 12 at 40 s, no record yet: a line
        clock[0] += 5
        log.log(record(12))  # a record at 45 s: the next line is due 30 s after it
        clock[0] += 27
        log.step(tokens=1000)  # 72 s: 32 s after the last line but 27 s after the record: none
        clock[0] += 8
        log.step(tokens=1000)  # 80 s, 35 s after the record: a line
    finally:
        log.close()
    printed = lines(capsys)
    # at 40 s: 2 steps, 2,000 tokens -> 50 tokens/s; 88 steps left at 20 s each
    # at 80 s: 4 steps, 4,000 tokens in 80 s -> 50 tokens/s; 86 steps x 20 s
    assert printed[0] == "train: 12/100 steps, 50 tokens/s, 40s so far, 29m20s left"
    assert printed[1].startswith("step 12/100  loss 2.0000")
    assert printed[2:] == ["train: 14/100 steps, 50 tokens/s, 1m20s so far, 28m40s left"]
