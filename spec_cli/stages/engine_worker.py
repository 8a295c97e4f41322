"""The engine in the loop's worker process: `python -m spec_cli.stages.engine_worker CONFIG`,
started once by `spec train --eval-engine` (its side of it: spec_cli/trainer/engine_process.py).

For each checkpoint the trainer hands over, it exports the weights through `spec export`'s own path,
self-check included, and decodes the run's prompts with `spec eval`'s decode loop: greedy, a chain
of the run's depth, the target alone beside it on the same prompts. Its engine loads once: vLLM
takes each new export by its own in-place reload, PyTorch keeps its target. It runs those two
stages, so it sits among them; the trainer starts it by name and imports none of it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts.io import write_json
from spec_cli.errors import SpecError
from spec_cli.trainer.engine_process import PARENT_PID, RESULT_FD, WORKER_LOG, WorkerConfig


class Worker:
    """The engine, loaded once; `evaluate(step, checkpoint)` exports and decodes one checkpoint."""

    def __init__(self, cfg: WorkerConfig):
        import torch

        from spec_cli.data import chat_templates
        from spec_cli.eval.speculative import eos_ids
        from spec_cli.targets import loading

        self.cfg = cfg
        self.target_dir = loading.resolve_target(cfg.target)
        self.target_config = loading.load_config(self.target_dir)
        self.template = chat_templates.resolve(cfg.chat_template)
        self.tokenizer = loading.load_tokenizer(self.target_dir, self.template)
        self.device = loading.choose_device(cfg.device)
        self.dtype = loading.choose_dtype(cfg.dtype, self.device)
        self.eos = eos_ids(
            self.tokenizer, loading.generation_config(self.target_dir)
        ) | chat_templates.end_of_turn_ids(self.tokenizer, self.template)
        if self.device.type == "cuda" and cfg.memory is not None and cfg.engine == "torch":
            torch.cuda.set_per_process_memory_fraction(cfg.memory, self.device)
        self.session = None

    def _session(self, algorithm: str, conversations):
        from spec_cli.eval.session import TorchSession, VllmSession

        if self.session is None:
            if self.cfg.engine == "vllm":
                share = (
                    None
                    if self.cfg.memory is None or self.device.type != "cuda"
                    else self.cfg.memory / 2
                )
                self.session = VllmSession(
                    self.target_dir,
                    self.dtype,
                    self.cfg.depth,
                    algorithm,
                    memory=share,
                    max_model_len=self._context(conversations),
                )
            else:
                self.session = TorchSession(self.target_dir, self.device, self.dtype)
        return self.session

    def _context(self, conversations) -> int:
        """vLLM's max_model_len: the longest conversation's prompt at its last turn, with every earlier
        answer as long as it may be, and the draft tokens; not the target's whole context (a 128k context
        would not fit the engine's KV cache beside training)."""
        from spec_cli.eval import prompts
        from spec_cli.targets import loading

        longest = 0
        for conv in conversations:
            last = len(conv.turns) - 1
            conv.answers = [""] * last
            longest = max(
                longest,
                len(prompts.prompt_ids(self.tokenizer, conv, last))
                + last * self.cfg.max_new_tokens,
            )
            conv.answers = []
        need = longest + self.cfg.max_new_tokens + self.cfg.depth + 64
        return min(loading.max_positions(self.target_config), need)

    def evaluate(self, step: int, checkpoint: Path) -> dict:
        start = time.perf_counter()
        folder = Path(checkpoint).parent
        export_dir = folder / "export"
        try:
            return self._evaluate(step, checkpoint, folder, export_dir, start)
        finally:  # the metrics are kept; the weights are in the snapshot
            shutil.rmtree(export_dir, ignore_errors=True)

    def _evaluate(
        self, step: int, checkpoint: Path, folder: Path, export_dir: Path, start: float
    ) -> dict:
        from spec_cli import threads
        from spec_cli.eval import drafts, prompts
        from spec_cli.eval.speculative import Settings
        from spec_cli.stages import eval as evaluation
        from spec_cli.stages import export

        exported = export.run(
            export.ExportConfig(
                source=Path(checkpoint),
                format=self.cfg.export_format,
                output=export_dir,
                dtype="fp32",
                check=True,
                target=str(self.target_dir),
                engine_check="none",
                overwrite=True,
            )
        )
        export_seconds = time.perf_counter() - start
        loaded = drafts.load_draft(export_dir, self.target_config)
        drafts.check_target(
            loaded, self.target_dir, self.target_config, self.tokenizer, True, self.template
        )
        settings = Settings(
            depth=self.cfg.depth,
            topk=1,
            num_tokens=self.cfg.depth,
            temperature=0.0,
            max_new_tokens=self.cfg.max_new_tokens,
            eos_ids=self.eos,
        )
        conversations = prompts.load_conversations(self.cfg.prompts, self.cfg.num_prompts)
        session = self._session(loaded.model.config.algorithm, conversations)
        spec, base = session.decoders(export_dir if self.cfg.engine == "vllm" else loaded, settings)
        first = prompts.prompt_ids(self.tokenizer, conversations[0], 0)
        warm = replace(
            settings, max_new_tokens=min(evaluation.WARMUP_TOKENS, settings.max_new_tokens)
        )
        spec(first, None, warm)
        base(first, None, warm)
        meter = threads.Meter()
        decoding = time.perf_counter()
        overall, _, _ = evaluation.decode_all(
            spec,
            base,
            self.tokenizer,
            conversations,
            settings,
            None,
            outputs=folder / "outputs.jsonl",
        )
        used = __import__("torch").get_num_threads()
        busy = meter.stop(used, threads.available_cores(), on_cpu=self.device.type == "cpu")
        metrics = overall.metrics()
        seconds = time.perf_counter() - start
        write_json(
            folder / "eval.json",
            {
                "kind": "engine_eval",
                "step": step,
                "engine": session.info,
                "checkpoint": str(checkpoint),
                "export": {
                    "format": exported.format,
                    "self_check": exported.check is not None,
                    "seconds": round(export_seconds, 2),
                },
                "settings": {
                    "depth": self.cfg.depth,
                    "topk": 1,
                    "temperature": 0.0,
                    **session.decoding_rule(settings),
                    "max_new_tokens": self.cfg.max_new_tokens,
                    "prompts": self.cfg.prompts,
                    "dtype": str(self.dtype).replace("torch.", ""),
                    "device": str(self.device),
                    "threads": used,
                },
                "overall": metrics,
                "busy": busy,
                "seconds": round(seconds, 2),
            },
        )
        return {
            "engine": self.cfg.engine,
            "depth": self.cfg.depth,
            "prompts": self.cfg.prompts,
            "turns": metrics["turns"],
            "acceptance_length": metrics["acceptance_length"],
            "acceptance_rate": metrics["acceptance_rate"],
            "accepted": metrics["accepted"],
            "verified": metrics["verified"],
            "speedup": metrics["speedup"],
            "spec_tokens_per_s": metrics["spec_tokens_per_s"],
            "target_tokens_per_s": metrics["target_tokens_per_s"],
            "same_as_target": metrics["same_as_target"],
            "seconds": round(seconds, 2),
            "decode_seconds": round(time.perf_counter() - decoding, 2),
            "export_seconds": round(export_seconds, 2),
            "warning": busy.get("warning"),
        }

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def main(argv: list[str] | None = None) -> int:
    """The worker: one JSON request a line on stdin ({"step", "checkpoint"} or {"stop": true}), one
    answer a line on the file descriptor $SPEC_ENGINE_EVAL_FD; its own output goes to worker.log."""
    import torch

    argv = sys.argv[1:] if argv is None else argv
    cfg = WorkerConfig(**json.loads(Path(argv[0]).read_text()))
    _watch_parent(int(os.environ.get(PARENT_PID, "0") or 0))
    answers = os.fdopen(int(os.environ[RESULT_FD]), "w", buffering=1, encoding="utf-8")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(max(1, cfg.threads))
    from spec_cli.console import set_quiet

    set_quiet(True)
    worker = None
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            if request.get("stop"):
                break
            step = int(request["step"])
            try:
                worker = worker or Worker(cfg)
                answer = {"step": step, **worker.evaluate(step, Path(request["checkpoint"]))}
            except SpecError as exc:
                answer = {
                    "step": step,
                    "error": exc.message + (f" ({exc.hint})" if exc.hint else ""),
                }
            except Exception as exc:  # noqa: BLE001 (a bug: its traceback goes to the log)
                traceback.print_exc()
                answer = {
                    "step": step,
                    "error": f"{type(exc).__name__}: {exc} (see {Path(cfg.run_dir) / ckpt.ENGINE_EVAL / WORKER_LOG})",
                }
            print(f"step {step}: {json.dumps(answer)}", flush=True)
            answers.write(json.dumps(answer) + "\n")
    finally:
        if worker is not None:
            worker.close()
        answers.close()
    return 0


def _watch_parent(parent: int) -> None:
    """End this process when the trainer that started it is gone (killed, say, with no chance to stop
    it): a worker left behind would hold its engine's memory and write into the run folder."""
    if parent <= 0:
        return

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    sys.exit(main())
