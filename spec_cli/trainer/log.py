"""What `spec train` shows and keeps: a rich live view, log.jsonl, TensorBoard (when installed), and
a PNG of the curves at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Group
from rich.live import Live
from rich.table import Table

from spec_cli.artifacts.io import atomic_path
from spec_cli.console import (
    Bar,
    ProgressLines,
    console,
    info,
    is_quiet,
    progress_display,
    progress_enabled,
    progress_lines_enabled,
)


def _fmt_acc(acc: list[float], n: int = 4) -> str:
    return " ".join(f"{a:.3f}" for a in acc[:n]) + (" …" if len(acc) > n else "")


def forget_after(path: Path, step: int) -> None:
    """A resumed run's log (at `step`, its checkpoint's): the records of the steps after it, which the
    stopped run logged but did not save and the resumed run logs again, taken out, so each step is
    logged once. Rewritten atomically; a line cut off by a kill is dropped too."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("step"), int)
            or record["step"] <= step
        ):
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        with atomic_path(path) as tmp:
            tmp.write_text("".join(kept))


class TrainLogger:
    """On a terminal: the last log record as a table over a bar of the steps, which advances every
    step with the tokens/s of this process and the time left, re-rendered twice a second."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        enabled: bool = True,
        start_step: int = 0,
        world: int = 1,
    ):
        self.run_dir = Path(run_dir)
        self.total = total_steps
        self.enabled = enabled  # rank 0 only
        self.path = self.run_dir / "log.jsonl"
        self.start = time.perf_counter()
        self.first_step: int | None = None
        self.live: Live | None = None
        self.bar: Bar | None = None
        self.last_eval: dict | None = None
        self.last_engine: dict | None = None  # --eval-engine's last answer
        self.tb = None
        self.lines: ProgressLines | None = (
            None  # off a terminal: lines in the silences between records
        )
        if not enabled:
            return
        forget_after(self.path, start_step)
        try:  # TensorBoard when installed
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        except Exception:
            self.tb = None
        if progress_enabled():
            self.display = progress_display("steps", rate="tokens")
            self.bar = Bar(
                self.display, "train" if world == 1 else "train (rank 0)", total_steps, start_step
            )
            self.live = Live(
                self._view(None), console=console, refresh_per_second=2, transient=False
            )
            self.live.start()
        elif progress_lines_enabled():
            self.lines = ProgressLines(
                "train" if world == 1 else "train (rank 0)",
                total_steps,
                unit="steps",
                rate="tokens",
                completed=start_step,
                announce=False,  # the run's own "training: ..." line says the work
            )

    def step(self, tokens: int) -> None:
        """One optimizer step done, over `tokens` tokens of this process."""
        if self.bar is not None:
            self.bar.advance(1, count=tokens)
        if self.lines is not None:
            self.lines.advance(1, count=tokens)

    def _view(self, record: dict | None) -> Group:
        return Group(self._table(record), self.display)

    def _table(self, record: dict | None) -> Table:
        table = Table(title="spec train", show_header=True, title_justify="left")
        columns = [
            "step",
            "loss",
            "acc per TTT step",
            "sim. accept len",
            "tokens/s",
            "eval acc0 / accept len",
        ]
        engine = self.last_engine
        if engine is not None:
            columns.append(f"{engine['engine']} accept len @ step")
        for col in columns:
            table.add_column(col, overflow="fold")
        if record:
            ev = self.last_eval
            row = [
                f"{record['step']}/{self.total}",
                f"{record['loss']:.4f}",
                _fmt_acc(record["acc"]),
                f"{record['acceptance_length']:.3f}",
                f"{record['tokens_per_s']:.0f}",
                f"{ev['acc'][0]:.3f} / {ev['acceptance_length']:.3f}" if ev else "-",
            ]
            if engine is not None:
                row.append(f"{engine['acceptance_length']:.3f} @ {engine['step']}")
            table.add_row(*row)
        return table

    def log(self, record: dict, text: str | None = None) -> None:
        """Append `record` to log.jsonl (and TensorBoard) and show it; `text`: an engine answer's line."""
        if not self.enabled:
            return
        if record["split"] == "engine":
            self._engine(record, text)
            return
        if record["split"] == "train":
            if self.first_step is None:
                self.first_step = record["step"] - record.get("steps_in_record", 1)
            done = record["step"] - self.first_step
            per_step = (time.perf_counter() - self.start) / max(done, 1)
            record["eta_s"] = per_step * (self.total - record["step"])
        else:
            self.last_eval = record
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            prefix = record["split"]
            self.tb.add_scalar(f"{prefix}/loss", record["loss"], record["step"])
            self.tb.add_scalar(
                f"{prefix}/acceptance_length", record["acceptance_length"], record["step"]
            )
            for k, a in enumerate(record["acc"]):
                self.tb.add_scalar(f"{prefix}/acc_step{k}", a, record["step"])
        if self.live is not None and record["split"] == "train":
            self.live.update(self._view(record))
        elif not is_quiet():
            if record["split"] == "train":
                info(
                    f"step {record['step']}/{self.total}  loss {record['loss']:.4f}  acc "
                    f"{_fmt_acc(record['acc'])}  accept len {record['acceptance_length']:.3f}  "
                    f"{record['tokens_per_s']:.0f} tok/s  "
                    + (
                        f"peak {record['peak_memory_gb']:.1f} GB  "
                        if "peak_memory_gb" in record
                        else ""
                    )
                    + f"eta {record['eta_s'] / 60:.1f} min"
                )
                if self.lines is not None:
                    self.lines.heard()
            else:
                info(
                    f"eval @ {record['step']}  loss {record['loss']:.4f}  acc {_fmt_acc(record['acc'])}  "
                    f"accept len {record['acceptance_length']:.3f}"
                )

    def _engine(self, record: dict, text: str | None) -> None:
        """An answer of the engine in the loop (spec_cli/trainer/engine.py): logged when it arrives,
        after the train records of the steps run meanwhile; its line is printed above the live view."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if "error" not in record:
            self.last_engine = record
            if self.tb is not None:
                self.tb.add_scalar(
                    "engine/acceptance_length", record["acceptance_length"], record["step"]
                )
                self.tb.add_scalar("engine/speedup", record["speedup"], record["step"])
                for j, rate in enumerate(record.get("acceptance_rate") or []):
                    if rate is not None:
                        self.tb.add_scalar(
                            f"engine/acceptance_rate_pos{j + 1}", rate, record["step"]
                        )
        if text and not is_quiet():
            info(text)

    def close(self) -> None:
        if self.lines is not None:  # (no last line: the run's summary says its steps and time)
            self.lines.stop()
            self.lines = None
        if self.live is not None:
            self.live.stop()
            self.live = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def read_log(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(run_dir: Path) -> Path | None:
    """training.png: loss, and step-0 accuracy / simulated acceptance length, train and eval."""
    records = read_log(Path(run_dir) / "log.jsonl")
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engine = [r for r in records if r["split"] == "engine" and "error" not in r]
    fig, axes = plt.subplots(1, 4 if engine else 3, figsize=(20 if engine else 15, 4))
    for split, style in (("train", "-"), ("eval", "o-")):
        rows = [r for r in records if r["split"] == split]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["loss"] for r in rows], style, label=split)
        for k in range(len(rows[0]["acc"])):
            if split == "eval" or k == 0:
                axes[1].plot(
                    steps,
                    [r["acc"][k] for r in rows],
                    style,
                    label=f"{split} step {k}",
                    alpha=1.0 if k == 0 else 0.5,
                )
        axes[2].plot(steps, [r["acceptance_length"] for r in rows], style, label=split)
    titles = ["loss", "top-1 accuracy per TTT step", "simulated acceptance length"]
    if (
        engine
    ):  # the engine's real acceptance beside the teacher-forced simulation, and per position
        engine.sort(key=lambda r: r["step"])
        name, steps = engine[0]["engine"], [r["step"] for r in engine]
        axes[2].plot(
            steps,
            [r["acceptance_length"] for r in engine],
            "s-",
            color="black",
            label=f"{name}, decoded",
        )
        best = [r for r in engine if r.get("best")]
        if best:
            axes[2].plot(
                [best[-1]["step"]],
                [best[-1]["acceptance_length"]],
                "*",
                color="red",
                markersize=14,
                label=f"RUN/best (step {best[-1]['step']})",
            )
        for j in range(max(len(r.get("acceptance_rate") or []) for r in engine)):
            axes[3].plot(
                steps,
                [
                    (r.get("acceptance_rate") or [None] * (j + 1))[j]
                    if j < len(r.get("acceptance_rate") or [])
                    else None
                    for r in engine
                ],
                "o-",
                label=f"position {j + 1}",
            )
        titles[2] = f"acceptance length: simulated, and decoded in {name}"
        titles.append(f"{name}: acceptance rate per draft position")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
