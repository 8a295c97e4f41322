"""spec train's live view: a bar of the steps (tokens/s, time left) under the last log record."""

import io
import re

from rich.console import Console

from spec_cli.trainer import log as train_log


def test_the_steps_bar_advances_every_step_with_tokens_per_second(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(train_log, "console", Console(file=out, force_terminal=True, width=80))
    monkeypatch.setattr(train_log, "progress_enabled", lambda: True)
    logger = train_log.TrainLogger(tmp_path, total_steps=100, start_step=40)  # resumed at step 40
    for _ in range(3):
        logger.step(1000)
    task = logger.display.tasks[0]
    assert (task.total, task.completed, task.fields["counted"]) == (100, 43, 3000)
    logger.log(
        {
            "split": "train",
            "step": 43,
            "loss": 1.25,
            "acc": [0.5, 0.4, 0.3, 0.2],
            "acceptance_length": 2.0,
            "tokens_per_s": 1234.0,
            "steps_in_record": 3,
        }
    )
    logger.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's control codes
    assert "43/100 steps" in text and " tokens/s" in text and re.search(r"eta \d:\d\d:\d\d", text)
    assert "1.2500" in text and "…" not in text
