"""A torchrun job for tests/draft/test_msd.py: `spec train ARGS` with rank 1's MSD curriculum drawing the
other source at one step (what ranks reading other data would do); the run must stop with the
curriculum check's one-line error on every rank, before any step."""

from __future__ import annotations

import contextlib
import io
import os


def main(*argv: str) -> None:
    from spec_cli.cli import main as spec
    from spec_cli.draft.msd import curriculum

    if os.environ["RANK"] == "1":
        real = curriculum.Curriculum.source
        curriculum.Curriculum.source = lambda self, step: (
            1 - real(self, step) if step == 2 else real(self, step)
        )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = spec(list(argv))
    said = " ".join(err.getvalue().split())
    assert code == 1 and "the MSD curriculum differs between ranks" in said, (code, said[-2000:])
