"""Progress bars (rate and time left from the first advance, counted down between advances) and
summaries that never cut a value at 80 columns."""

import io
import time

from rich.console import Console
from rich.progress import Progress, TimeRemainingColumn

import spec_cli.console as console_mod
from spec_cli.console import Bar, EtaColumn, RateColumn, progress, summary


def test_time_left_and_rate_come_from_the_work_done_so_far():
    now = [0.0]
    display = Progress(get_time=lambda: now[0])
    bar = Bar(display, "precompute", total=1000)
    task = display.tasks[0]
    eta, rate, counted = EtaColumn(), RateColumn("tokens"), RateColumn("tokens", counted=True)
    assert eta.render(task).plain == "eta -:--:--" and rate.render(task).plain == "- tokens/s"

    now[0] = 30.0
    bar.advance(100, count=6000)  # one big jump after 30 s: 10% done
    assert eta.render(task).plain == "eta 0:04:30"
    assert (
        rate.render(task).plain == "3.33 tokens/s" and counted.render(task).plain == "200 tokens/s"
    )
    # what read -:--:-- for 35 minutes: rich's own column has no speed from a single advance
    assert TimeRemainingColumn().render(task).plain == "-:--:--"

    now[0] = 40.0  # no advance since: the time left counts down, the rate stays
    assert eta.render(task).plain == "eta 0:04:20" and rate.render(task).plain == "3.33 tokens/s"
    now[0] = 60.0
    bar.advance(100)  # 20% after 60 s
    assert eta.render(task).plain == "eta 0:04:00"
    now[0] = 500.0  # late: never negative
    assert eta.render(task).plain == "eta 0:00:00"


def test_a_resumed_bar_estimates_from_this_run_only():
    now = [0.0]
    display = Progress(get_time=lambda: now[0])
    bar = Bar(display, "train", total=1000, completed=500)  # resumed at step 500
    now[0] = 10.0
    bar.advance(10, count=100)
    assert EtaColumn().render(display.tasks[0]).plain == "eta 0:08:10"  # 490 steps at 1 step/s
    assert display.tasks[0].completed == 510


def test_the_bar_is_redrawn_between_advances(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(console_mod, "console", Console(file=out, force_terminal=True, width=80))
    monkeypatch.setattr(console_mod, "progress_enabled", lambda: True)
    with progress("precompute", total=10, unit="tokens") as bar:
        bar.advance(1)
        time.sleep(1.2)  # no advance: elapsed and time left still move
    assert out.getvalue().count("precompute") >= 3  # the first draw, redraws in between, the last


def test_summary_wraps_a_long_path_at_80_columns_instead_of_cutting_it(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(console_mod, "console", Console(file=out, width=80))
    path = (
        "/data/runs/[exp-1]/" + "/".join(f"folder{i:02d}" for i in range(14)) + "/model.safetensors"
    )
    assert len(path) > 150
    summary("export", [("written", path), ("time", "1.0 s")])
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert path in "".join(text.split())  # whole, once rich's line breaks and padding are removed


def test_under_torchrun_rank_0_alone_speaks_and_each_rank_its_errors(monkeypatch, capsys, tmp_path):
    """Every rank runs the same command: progress lines, warnings, summaries and the stopped line come from
    rank 0 alone; a rank's line about itself (waiting for rank 0) and a failing rank's error from every rank."""
    import signal

    from spec_cli import stopping
    from spec_cli.cli import main
    from spec_cli.console import info, warn
    from spec_cli.errors import ConfigError
    from spec_cli.stages import train as stage

    def ends(error):
        def run(*args, **kwargs):
            raise error()  # (a Stopped made inside the command: the command's signal handling records it)

        return run

    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(console_mod, "_quiet", False)
        info("a progress line")
        warn("a warning")
        summary("train", [("run", "RUN")])
        info("rank waits for rank 0", every_rank=True)
        monkeypatch.setattr(stage, "run", ends(lambda: stopping.Stopped(signal.SIGTERM)))
        assert main(["train", "-o", str(tmp_path / "run"), "-q"]) == 143
        monkeypatch.setattr(stage, "run", ends(lambda: ConfigError("this rank failed", "fix it")))
        assert main(["train", "-o", str(tmp_path / "run"), "-q"]) == 1
        said[rank] = capsys.readouterr()
    assert said["1"].out == "rank waits for rank 0\n"
    assert said["1"].err == "error: this rank failed; fix it\n"
    out, err = said["0"].out, " ".join(said["0"].err.split())
    assert "a progress line" in out and "RUN" in out and "rank waits for rank 0" in out
    assert err == (
        "warning: a warning stopped (SIGTERM); finished work is kept: rerun the same command to continue "
        "(regenerate and precompute go on where they stopped, train with --resume) error: this rank "
        "failed; fix it"
    )
