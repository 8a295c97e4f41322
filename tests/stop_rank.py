"""Run by tests/test_distributed.py's torchrun launch: `spec train ARGS` in which only rank RANK gets
SIGTERM, during its optimizer update of step STEP (as a scheduler's signals reach ranks at different
moments). Every rank must exit 143 having stopped after the same step.

    ["-m", "tests.stop_rank", RANK, STEP, "train", ...] in tests/launch.py's job list
"""

import os
import signal

from spec_cli import distributed
from spec_cli.cli import main as spec
from spec_cli.trainer.trainer import Trainer


def main(rank: str, step: str, *argv: str) -> None:
    real, done = Trainer.optimizer_step, [0]

    def optimizer_step(self):
        out = real(self)
        done[0] += 1
        if done[0] == int(step) and distributed.rank() == int(rank):
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    Trainer.optimizer_step = optimizer_step
    try:
        code = spec(list(argv))
    finally:
        Trainer.optimizer_step = real
    assert code == 143, f"`spec {' '.join(argv)}` exited {code}, not 143 (stopped by SIGTERM)"
