"""README.md of an export folder: how to serve it, what it was trained for, how good it measured."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from spec_cli.draft import algorithms
from spec_cli.draft.contract import ExportFiles
from spec_cli.engine.vllm_versions import serving_line
from spec_cli.export.source import DraftSource


def format_title(fmt: str) -> str:
    """How people name the engine a format is for ("vLLM (speculators format)"), as its algorithms declare."""
    return next(
        (f.title for a in algorithms.ALGORITHMS.values() for f in a.formats if f.name == fmt), fmt
    )


def model_impl(served: bool | None, engine: str) -> str | None:
    """vLLM's `--model-impl` for an export written with --allow-unsupported-target: the engine's native
    class for the target cannot capture aux states (`served` False for a vLLM `engine`), and vLLM's
    Transformers backend implements the capture for any architecture it runs (export/support.py)."""
    return "transformers" if served is False and str(engine).startswith("vLLM") else None


def export_model_impl(folder: Path) -> str | None:
    """model_impl of an export folder, from the engine support its config.json records."""
    try:
        recorded = json.loads((Path(folder) / "config.json").read_text())["spec_cli"][
            "engine_support"
        ]
        return model_impl(recorded.get("served"), recorded.get("engine", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def speculative_config(served_as, folder: Path, steps: int) -> dict:
    """vLLM's `--speculative-config` for an export of `served_as` (an ExportFormat vLLM reads): the
    format's method, the folder, `steps` draft tokens per step and the format's own keys (P-EAGLE's
    parallel_drafting). The README's serve command and `spec tune` both start vLLM with it."""
    return {
        "method": served_as.method,
        "model": str(folder),
        "num_speculative_tokens": int(steps),
        **dict(served_as.engine_options),
    }


def serve_command(
    fmt: str,
    folder: Path,
    target: str | None,
    steps: int,
    algorithm: str = "eagle3",
    impl: str | None = None,
) -> str:
    """The serving command for this export (flag names from the engines' docs / server args); impl:
    vLLM's --model-impl (model_impl)."""
    target = target or "TARGET"
    folder = str(folder)
    served_as = algorithms.get(algorithm).format(fmt)
    if served_as.engine == "sglang":
        # python/sglang/srt/server_args.py; with top-k 1 the draft tree is a chain of num_steps + 1 tokens
        return (
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
            f"--speculative-algorithm {served_as.method} --speculative-draft-model-path {shlex.quote(folder)} "
            f"--speculative-num-steps {steps} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {steps + 1}"
        )
    if served_as.engine != "vllm":
        return f"(no serving engine reads the {fmt} format; load {folder} with the code that defines it)"
    spec = json.dumps(speculative_config(served_as, folder, steps))
    return (
        f"vllm serve {shlex.quote(target)}"
        + (f" --model-impl {impl}" if impl else "")
        + f" --speculative-config {shlex.quote(spec)}"
    )


def tune_lines(fmt: str, folder: Path, target: str | None, algorithm: str) -> list[str]:
    """How to measure the speculation length that serves this draft fastest at each batch size."""
    served_as = algorithms.get(algorithm).format(fmt)
    if served_as.engine not in ("vllm", "sglang"):
        return []
    where = shlex.quote(str(folder))
    target = shlex.quote(target or "TARGET")
    if served_as.engine == "vllm":
        return [
            "## Tune for your batch sizes",
            "",
            "A draft that speeds up one request can slow a busy server. Measure vLLM's output tokens/s "
            "with 0 .. 5 draft tokens at batch sizes 1 .. 16 on your hardware; `serving.json` then holds "
            "the `speculative_config` (a `num_speculative_tokens_per_batch_size` schedule) that was "
            "fastest at each size:",
            "",
            "```bash",
            f"spec tune {where} --target {target}",
            "```",
            "",
        ]
    return [
        "## Tune the draft tree",
        "",
        "SGLang serves EAGLE-2 trees; measure chains and trees (depth, top-k, nodes) at batch 1 in "
        "spec_cli's decoder on your hardware:",
        "",
        "```bash",
        f"spec tune {where} --target {target} --engine torch",
        "```",
        "",
    ]


def render(
    src: DraftSource, files: ExportFiles, folder: Path, dtype_name: str, support=None
) -> str:
    c = src.config
    fmt, steps = files.format, files.num_speculative_tokens
    lines = [
        f"# {algorithms.get(c.algorithm).title} draft for {c.target_architecture or 'the target'} ({format_title(fmt)})",
        "",
        f"Exported by `spec export --format {fmt}` from `{src.checkpoint}` (step {src.step}), "
        f"weights in {dtype_name}.",
        "",
        "## Serve",
        "",
        "```bash",
        serve_command(
            fmt,
            folder,
            src.target,
            steps,
            c.algorithm,
            None if support is None else model_impl(support.served, support.engine),
        ),
        "```",
        "",
        serving_line(algorithms.get(c.algorithm)) + ".",
        "",
    ]
    if fmt == "speculators":
        lines += [
            "vLLM also serves a speculators folder directly, taking the target from "
            "`speculators_config.verifier.name_or_path`:",
            "",
            "```bash",
            f"vllm serve {shlex.quote(str(folder))}",
            "```",
            "",
        ]
    if src.target is None:
        lines += [
            "Replace `TARGET` with the target model the draft was trained for (see below).",
            "",
        ]
    lines += tune_lines(fmt, folder, src.target, c.algorithm)
    unknown = "unknown"
    lines += [
        f"`{steps}` draft tokens per step; the draft was trained with --ttt-steps "
        f"{src.ttt_steps or unknown}, so deeper settings see states it never trained on.",
        "",
    ]
    lines += getattr(algorithms.get(c.algorithm).code, "readme_lines", lambda src, files: [])(
        src, files
    )
    lines += [
        "## Target",
        "",
        f"- architecture: `{c.target_architecture or unknown}`, {c.target_num_layers} decoder layers, "
        f"hidden size {c.target_hidden_size}, vocab {c.vocab_size}",
        f"- path: `{src.target or unknown}`",
        f"- fingerprint: `{c.target_fingerprint or unknown}` "
        f"(tokenizer `{c.tokenizer_fingerprint or unknown}`)",
        f"- aux layers (outputs of 0-indexed decoder layers): {files.aux_layer_outputs}; written for "
        f"{format_title(fmt)} as `{files.engine_aux_ids}`",
        f"- draft vocab: {c.draft_vocab_size} target ids "
        f"(vocab map `{c.vocab_map_fingerprint or unknown}`)",
        "- chat template the training data was rendered with: "
        + (
            f"{c.chat_template_source} (sha256 `{c.chat_template_sha256}`); serve with the same template"
            if c.chat_template_sha256
            else unknown
        ),
        "",
        "Serve it with exactly this target: another model (or revision) gives low acceptance "
        "without any error.",
        "",
        "## Draft layer",
        "",
        f"- rope: theta {c.rope_theta:g}, scaling `{json.dumps(c.rope_scaling)}` (written as `rope_theta`, "
        "`rope_scaling` and `rope_parameters`, which vLLM and SGLang read)",
        f"- why: {c.rope_source or unknown}",
        "",
    ]
    if support is not None and support.served is not True:
        lines += [
            "## Engine support",
            "",
            f"WARNING: {support.reason} (from {support.source}). "
            "This folder was written anyway; check that your engine captures this target's aux "
            "hidden states before relying on it.",
            "",
        ]
    if c.fc_norm or c.norm_output:
        lines += [
            "## EAGLE-3.1",
            "",
            f"Trained with fc_norm={c.fc_norm}, norm_output={c.norm_output}. Engines without EAGLE-3.1 "
            "support ignore `norm_output` silently: use a vLLM / SGLang release whose llama_eagle3.py "
            "reads `fc_norm` and `norm_output`.",
            "",
        ]
    lines += ["## Measured quality", ""]
    e = src.last_eval
    if e:
        acc = ", ".join(f"{a:.3f}" for a in e["acc"])
        lines += [
            f"Held-out evaluation at step {e['step']} (simulated, teacher-forced):",
            "",
            f"- top-1 accuracy per draft step: {acc}",
            f"- simulated acceptance length: {e['acceptance_length']:.3f}",
            "",
            "Measure real acceptance on the engine with `spec eval`.",
            "",
        ]
    else:
        lines += ["No evaluation record was found in the run's log.jsonl.", ""]
    return "\n".join(lines)
