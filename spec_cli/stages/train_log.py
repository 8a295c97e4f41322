"""What `spec train` shows and keeps: a rich live view, log.jsonl, TensorBoard (when installed), and
a PNG of the curves at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Group
from rich.live import Live
from rich.table import Table

from spec_cli.console import Bar, console, info, is_quiet, progress_display, progress_enabled


def _fmt_acc(acc: list[float], n: int = 4) -> str:
    return " ".join(f"{a:.3f}" for a in acc[:n]) + (" …" if len(acc) > n else "")


class TrainLogger:
    """On a terminal: the last log record as a table over a bar of the steps, which advances every
    step with the tokens/s of this process and the time left, re-rendered twice a second."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool = True, start_step: int = 0,
                 world: int = 1):
        self.run_dir = Path(run_dir)
        self.total = total_steps
        self.enabled = enabled  # rank 0 only
        self.path = self.run_dir / "log.jsonl"
        self.start = time.perf_counter()
        self.first_step: int | None = None
        self.live: Live | None = None
        self.bar: Bar | None = None
        self.last_eval: dict | None = None
        self.tb = None
        if not enabled:
            return
        try:  # TensorBoard when installed
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        except Exception:
            self.tb = None
        if progress_enabled():
            self.display = progress_display("steps", rate="tokens")
            self.bar = Bar(self.display, "train" if world == 1 else "train (rank 0)", total_steps, start_step)
            self.live = Live(self._view(None), console=console, refresh_per_second=2, transient=False)
            self.live.start()

    def step(self, tokens: int) -> None:
        """One optimizer step done, over `tokens` tokens of this process."""
        if self.bar is not None:
            self.bar.advance(1, count=tokens)

    def _view(self, record: dict | None) -> Group:
        return Group(self._table(record), self.display)

    def _table(self, record: dict | None) -> Table:
        table = Table(title="spec train", show_header=True, title_justify="left")
        for col in ("step", "loss", "acc per TTT step", "sim. accept len", "tokens/s", "eval acc0 / accept len"):
            table.add_column(col, overflow="fold")
        if record:
            ev = self.last_eval
            table.add_row(f"{record['step']}/{self.total}", f"{record['loss']:.4f}", _fmt_acc(record["acc"]),
                          f"{record['acceptance_length']:.3f}", f"{record['tokens_per_s']:.0f}",
                          f"{ev['acc'][0]:.3f} / {ev['acceptance_length']:.3f}" if ev else "-")
        return table

    def log(self, record: dict) -> None:
        if not self.enabled:
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
            self.tb.add_scalar(f"{prefix}/acceptance_length", record["acceptance_length"], record["step"])
            for k, a in enumerate(record["acc"]):
                self.tb.add_scalar(f"{prefix}/acc_step{k}", a, record["step"])
        if self.live is not None and record["split"] == "train":
            self.live.update(self._view(record))
        elif not is_quiet():
            if record["split"] == "train":
                info(f"step {record['step']}/{self.total}  loss {record['loss']:.4f}  acc "
                     f"{_fmt_acc(record['acc'])}  accept len {record['acceptance_length']:.3f}  "
                     f"{record['tokens_per_s']:.0f} tok/s  "
                     + (f"peak {record['peak_memory_gb']:.1f} GB  " if "peak_memory_gb" in record else "")
                     + f"eta {record['eta_s'] / 60:.1f} min")
            else:
                info(f"eval @ {record['step']}  loss {record['loss']:.4f}  acc {_fmt_acc(record['acc'])}  "
                     f"accept len {record['acceptance_length']:.3f}")

    def close(self) -> None:
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

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for split, style in (("train", "-"), ("eval", "o-")):
        rows = [r for r in records if r["split"] == split]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["loss"] for r in rows], style, label=split)
        for k in range(len(rows[0]["acc"])):
            if split == "eval" or k == 0:
                axes[1].plot(steps, [r["acc"][k] for r in rows], style,
                             label=f"{split} step {k}", alpha=1.0 if k == 0 else 0.5)
        axes[2].plot(steps, [r["acceptance_length"] for r in rows], style, label=split)
    for ax, title in zip(axes, ("loss", "top-1 accuracy per TTT step", "simulated acceptance length")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
