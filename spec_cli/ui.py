"""What the CLI prints at the end of each stage, and `spec inspect`."""

from __future__ import annotations

import json
from pathlib import Path

from spec_cli.console import console, summary
from spec_cli.errors import ArtifactError


def _skipped(skipped: dict) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in skipped.items()) or "none"


def _coverage(by_size: dict) -> str:
    return "  ".join(f"{int(size)}: {value:.4f}" for size, value in
                     sorted(by_size.items(), key=lambda kv: int(kv[0])))


def print_vocab_map_summary(result) -> None:
    meta, tok = result.vocab_map.metadata, result.tokens.metadata
    summary("build-vocab-map", [
        ("target", meta["target"]),
        ("data", f"{meta['data']} ({tok['num_records']} records)"),
        ("tokenised", f"{tok['num_samples']} samples, {tok['num_tokens']} tokens, "
                      f"{tok['num_supervised']} supervised"
                      + (" (from cache)" if tok.get("cache_hit") else "")),
        ("skipped", _skipped(tok["skipped"])),
        ("distinct supervised ids", f"{meta['num_distinct_tokens']} of {meta['target_vocab_size']}"),
        ("draft vocab", meta["draft_vocab_size"]),
        ("coverage", f"{meta['coverage']:.4f}"),
        ("coverage by Vd", _coverage(meta["coverage_by_size"])),
        ("written", str(result.output)),
        ("time", f"{result.seconds:.1f} s"),
    ])


def print_precompute_summary(result) -> None:
    m = result.manifest
    tokens_per_s = result.computed_tokens / result.compute_seconds if result.computed_tokens else 0
    summary("precompute", [
        ("target", f"{m['target']} ({m['architecture']}, aux layers {m['aux_layers']}, {m['dtype']})"),
        ("data", f"{m['data']} ({m['num_samples']} samples, {m['num_tokens']} tokens)"),
        ("batches", f"{m['num_batches']} (padding {result.padding:.1%})"),
        ("encoding", f"{m['encoding']}, {m['bytes_per_token']} bytes/token"),
        ("shards", f"{m['num_shards']} ({result.computed_shards} computed, {result.reused_shards} reused)"),
        ("size", f"{m['bytes'] / 1e9:.3f} GB"),
        ("throughput", f"{tokens_per_s:.0f} tokens/s" if tokens_per_s else "-"),
        ("written", str(result.output)),
        ("time", f"{result.seconds:.1f} s"),
    ])


def print_train_summary(result) -> None:
    rows = [("run", str(result.run_dir)), ("checkpoint", str(result.checkpoint)),
            ("steps", result.steps), ("time", f"{result.seconds / 60:.1f} min")]
    if result.total_steps and result.steps < result.total_steps:
        rows[2] = ("steps", f"{result.steps} of {result.total_steps} (--max-time reached; --resume continues)")
    if result.final_train:
        t = result.final_train
        rows.append(("train (last window)", f"loss {t['loss']:.4f}  acc step0 {t['acc'][0]:.3f}  "
                                            f"sim. accept len {t['acceptance_length']:.3f}"))
    if result.final_eval:
        e = result.final_eval
        rows.append(("eval", f"loss {e['loss']:.4f}  acc " + " ".join(f"{a:.3f}" for a in e["acc"])
                     + f"  sim. accept len {e['acceptance_length']:.3f}"))
    if result.plot:
        rows.append(("curves", str(result.plot)))
    summary("train", rows)


def print_demo_summary(result) -> None:
    rows = [(s.name, f"{s.status:<8} {s.seconds / 60:5.1f} min  {s.artifact}") for s in result.stages]
    if result.train_steps:
        rows.append(("train steps", result.train_steps))
    if result.acceptance_length is not None:
        p = result.profile
        rows.append(("acceptance length", f"{result.acceptance_length:.2f} tokens per target forward "
                                          f"(MT-bench, greedy, chain {p.eval_depth})"))
        rows.append(("speed-up", f"{result.speedup:.2f}x over the target alone (same prompts, same run)"))
    if result.eval_json is not None:
        rows.append(("eval report", str(result.eval_json)))
    if result.serve_command:
        rows.append(("serve with vLLM", result.serve_command))
    rows.append(("total", f"{result.seconds / 60:.1f} min; rerun `spec demo` to reuse the finished stages"))
    summary(f"spec demo ({result.profile.name}) in {result.folder}", rows)


def inspect_artifact(path: Path) -> None:
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path} does not exist", "check the path")
    if path.is_dir():
        if (path / "manifest.json").is_file():
            manifest = json.loads((path / "manifest.json").read_text())
            console.print(f"[bold]{path}[/]  kind: {manifest.get('kind')}  "
                          f"schema: {manifest.get('schema_version')}")
            for key, value in sorted(manifest.items()):
                if key != "shards":
                    console.print(f"  {key}: {value}")
            shards = manifest.get("shards", [])
            console.print(f"  shards: {len(shards)} files, {sum(s['bytes'] for s in shards)} bytes")
            return
        raise ArtifactError(f"{path} is a folder spec_cli does not know", "pass an artifact file or folder")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("spec_cli", "{}"))
            shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as exc:
        raise ArtifactError(f"{path} is not a safetensors artifact ({exc})",
                            "pass a file written by spec_cli") from exc
    console.print(f"[bold]{path}[/]  kind: {meta.get('kind', 'unknown')}  "
                  f"schema: {meta.get('schema_version', '?')}")
    for key, (shape, dtype) in shapes.items():
        console.print(f"  {key:24s} {dtype:6s} {list(shape)}")
    if "coverage_by_size" in meta:
        console.print(f"  coverage by Vd: {_coverage(meta['coverage_by_size'])}")
    for key, value in sorted(meta.items()):
        if key != "coverage_by_size":
            console.print(f"  {key}: {value}")
