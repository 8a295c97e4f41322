"""What the CLI prints at the end of each stage, and `spec inspect`."""

from __future__ import annotations

import json
from pathlib import Path

from spec_cli.console import console, human_bytes, summary
from spec_cli.errors import ArtifactError


def _skipped(skipped: dict) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in skipped.items()) or "none"


def _coverage(by_size: dict) -> str:
    return "  ".join(
        f"{int(size)}: {value:.4f}"
        for size, value in sorted(by_size.items(), key=lambda kv: int(kv[0]))
    )


def _threads(record: dict) -> str:
    """ " on 1 thread (why)" from a stage's "threads" and "threads_reason" ("" when not recorded)."""
    n = record.get("threads")
    return f" on {n} thread{'s' if n != 1 else ''} ({record.get('threads_reason')})" if n else ""


def _busy(record: dict | None) -> list[tuple[str, str]]:
    """A WARNING row when spec_cli.threads.Meter found the machine too busy for the speed to mean much."""
    return [("WARNING", record["warning"])] if (record or {}).get("warning") else []


def print_regenerate_summary(result) -> None:
    meta, counts = result.meta, result.meta["counts"]
    engine = meta["engine"]
    parts = f"{result.computed_parts} computed, {result.reused_parts} reused"
    summary(
        "regenerate",
        [
            (
                "output",
                f"{result.output}" + (" (already complete)" if result.already_complete else ""),
            ),
            (
                "records written",
                f"{counts['records_written']} of {counts['records_read']} read ({parts} chunks)",
            ),
            ("skipped", _skipped(counts["skipped"])),
            ("turns answered", counts["turns_answered"]),
            (
                "cut at the length limit",
                f'{counts["answers_cut_by_length"]} answers (finish_reason "length")',
            ),
            ("ended early", _skipped(counts["conversations_ended_early"])),
            ("tokens generated", counts["tokens_generated"]),
            ("tokens/s", f"{meta['tokens_per_second']:.1f}" + _threads(meta)),
            *_busy(meta.get("busy")),
            (
                "engine",
                f"{engine['name']} {engine.get('version') or ''}".rstrip() + f", {meta['dtype']}",
            ),
            *_features(meta.get("features")),
            ("provenance", f"{result.output}.meta.json"),
            ("time", f"{result.seconds:.1f} s"),
        ],
    )


def _features(features: dict | None) -> list[tuple[str, str]]:
    if not features:
        return []
    share = features.get("from_generation")
    rows = f"{features['rows_replayed']} rows from the generation's states" + (
        f", {features['rows_computed']} run again" if features["rows_computed"] else ""
    )
    return [
        (
            "feature cache",
            f"{features['cache']} ({rows}"
            + (
                f"; {share:.0%} of their positions computed while answering"
                if share is not None
                else ""
            )
            + ")",
        ),
        (
            "train with",
            f"spec train --cache {features['cache']} --vocab-map {features['vocab_map']}",
        ),
    ]


def _template(meta: dict) -> str:
    sha = meta.get("chat_template_sha256")
    return f"{meta.get('chat_template_source', '?')} (sha256 {sha[:12]})" if sha else "none"


def print_vocab_map_summary(result) -> None:
    meta, tok = result.vocab_map.metadata, result.tokens.metadata
    summary(
        "build-vocab-map",
        [
            ("target", meta["target"]),
            ("chat template", _template(meta)),
            ("data", f"{meta['data']} ({tok['num_records']} records)"),
            (
                "tokenised",
                f"{tok['num_samples']} samples, {tok['num_tokens']} tokens, "
                f"{tok['num_supervised']} supervised"
                + (" (from cache)" if tok.get("cache_hit") else ""),
            ),
            ("skipped", _skipped(tok["skipped"])),
            (
                "distinct supervised ids",
                f"{meta['num_distinct_tokens']} of {meta['target_vocab_size']}",
            ),
            ("draft vocab", meta["draft_vocab_size"]),
            ("coverage", f"{meta['coverage']:.4f}"),
            ("coverage by Vd", _coverage(meta["coverage_by_size"])),
            ("written", str(result.output)),
            ("time", f"{result.seconds:.1f} s"),
        ],
    )


def print_precompute_summary(result) -> None:
    m = result.manifest
    tokens_per_s = result.computed_tokens / result.compute_seconds if result.computed_tokens else 0
    on = _threads({"threads": result.threads, "threads_reason": result.threads_reason})
    summary(
        "precompute",
        [
            (
                "target",
                f"{m['target']} ({m['architecture']}, aux layers {m['aux_layers']}, {m['dtype']})",
            ),
            ("data", f"{m['data']} ({m['num_samples']} samples, {m['num_tokens']} tokens)"),
            ("batches", f"{m['num_batches']} (padding {result.padding:.1%})"),
            (
                "encoding",
                f"{m['encoding']}, {m['bytes_per_token']} bytes/token, stored in "
                f"{m.get('storage_dtype', m['dtype'])}",
            ),
            (
                "shards",
                f"{m['num_shards']} ({result.computed_shards} computed, {result.reused_shards} reused)",
            ),
            ("size", _cache_size(result)),
            ("throughput", f"{tokens_per_s:.0f} tokens/s{on}" if tokens_per_s else "-"),
            *_busy(result.busy),
            ("written", str(result.output)),
            ("time", f"{result.seconds:.1f} s"),
        ],
    )


def _cache_size(result) -> str:
    """Everything in the cache folder (shards, head, manifest) and the estimate the disk check used."""
    d = result.disk or {
        "shards": result.manifest["bytes"],
        "head": result.manifest.get("head_bytes", 0),
        "manifest": 0,
    }
    total = sum(d[k] for k in ("shards", "head", "manifest"))
    text = (
        f"{human_bytes(total)} (shards {human_bytes(d['shards'])}, head {human_bytes(d['head'])}, "
        f"manifest {human_bytes(d['manifest'])})"
    )
    return text + (
        f"; estimated {human_bytes(result.estimated_bytes)}" if result.computed_shards else ""
    )


def print_train_summary(result) -> None:
    rows = [
        ("run", str(result.run_dir)),
        ("checkpoint", str(result.checkpoint)),
        ("steps", result.steps),
        ("time", f"{result.seconds / 60:.1f} min"),
    ]
    if result.total_steps and result.steps < result.total_steps:
        rows[2] = (
            "steps",
            f"{result.steps} of {result.total_steps} (--max-time reached; --resume continues)",
        )
    if result.final_train:
        t = result.final_train
        rows.append(
            (
                "train (last window)",
                f"loss {t['loss']:.4f}  acc step0 {t['acc'][0]:.3f}  "
                f"sim. accept len {t['acceptance_length']:.3f}",
            )
        )
    if result.final_eval:
        e = result.final_eval
        rows.append(
            (
                "eval",
                f"loss {e['loss']:.4f}  acc "
                + " ".join(f"{a:.3f}" for a in e["acc"])
                + f"  sim. accept len {e['acceptance_length']:.3f}",
            )
        )
    engine = getattr(result, "engine", None)
    if engine:
        answered = [e for e in engine["evaluations"] if "error" not in e]
        failed = len(engine["evaluations"]) - len(answered)
        if answered:
            last = answered[-1]
            text = (
                f"{len(answered)} evaluation(s) in {last['engine']}: acceptance length "
                + ", ".join(f"{e['acceptance_length']:.3f} @ {e['step']}" for e in answered[-6:])
            )
            best = engine.get("best")
            if best:
                text += f"; best step {best['step']} ({best['acceptance_length']:.3f}), kept as {result.run_dir}/best"
            rows.append(("engine in the loop", text))
        if failed:
            rows.append(
                (
                    "engine in the loop",
                    f"{failed} evaluation(s) failed: see log.jsonl (split engine)",
                )
            )
    if result.plot:
        rows.append(("curves", str(result.plot)))
    summary("train", rows)


def print_demo_summary(result) -> None:
    def when(s) -> str:
        p = s.produced or {}
        if s.status == "reused" and p.get("seconds") is not None:  # what it took when it was made
            how = (
                "was made in regenerate" if p.get("status") == "in regenerate" else p.get("status")
            )
            return f"reused   (it {how} in {p['seconds'] / 60:.1f} min)  {s.artifact}"
        return f"{s.status:<8} {s.seconds / 60:5.1f} min  {s.artifact}"

    rows = [(s.name, when(s)) for s in result.stages]
    if result.train_steps:
        rows.append(("train steps", result.train_steps))
    curve = getattr(result, "engine_curve", None) or []
    if curve:
        engine = curve[0]["engine"]
        rows.append(
            (
                f"acceptance in {engine} while training",
                ", ".join(
                    f"{c['step']}: {c['acceptance_length']:.2f}" + ("*" if c.get("best") else "")
                    for c in curve
                )
                + " (held-out chats; * kept as the best so far)",
            )
        )
    exported, last = getattr(result, "exported_step", None), getattr(result, "last_step", None)
    if exported is not None:
        by_step = {c["step"]: c for c in curve}
        measured = lambda step: (
            f", acceptance {by_step[step]['acceptance_length']:.2f} in {by_step[step]['engine']}"  # noqa: E731
            if step in by_step
            else ""
        )
        rows.append(
            (
                "checkpoint exported",
                f"step {exported}{measured(exported)}"
                + (
                    f" (the best the engine measured; the last, step {last}{measured(last)})"
                    if last is not None and last != exported
                    else " (the last step)"
                ),
            )
        )
    for warning in result.warnings:
        rows.append(("WARNING", warning))
    vllm = getattr(result, "vllm", None)
    if vllm:  # the headline: what a vLLM server gets (MT-bench, the same turns as PyTorch's below)
        note = f"; per turn {vllm['note']}" if vllm.get("note") else ""
        rows.append(
            (
                "speed-up in vLLM",
                f"{vllm['speedup']:.2f}x over vLLM's target alone ({vllm['spec_tokens_per_s']:.1f} "
                f"vs {vllm['target_tokens_per_s']:.1f} tokens/s; acceptance length "
                f"{vllm['acceptance_length']:.2f}, MT-bench, greedy, chain "
                f"{result.profile.eval_depth}{note})",
            )
        )
    if getattr(result, "missing", ""):
        rows.append(("without vLLM", result.missing))
    if result.acceptance_length is not None:
        p = result.profile
        rows.append(
            (
                "acceptance length",
                f"{result.acceptance_length:.2f} tokens per target forward "
                f"(MT-bench, greedy, chain {p.eval_depth}, PyTorch)",
            )
        )
        note = getattr(result, "speed_note", "")
        per_turn = f"; per turn {note}" if note else ""
        tps = getattr(result, "torch_tps", None) or {}
        absolute = (
            f"{tps['spec_tokens_per_s']:.1f} vs {tps['target_tokens_per_s']:.1f} tokens/s; "
            if tps.get("spec_tokens_per_s")
            else ""
        )
        rows.append(
            (
                "speed-up in PyTorch",
                f"{result.speedup:.2f}x over the target alone ({absolute}same prompts, "
                f"same run{per_turn})",
            )
        )
        best = getattr(result, "fastest", None)
        if best and best["depth"] != p.eval_depth:
            rows.append(
                (
                    "fastest chain here",
                    f"{best['depth']}: speed-up {best['speedup']:.2f}x, acceptance "
                    f"length {best['acceptance_length']:.2f} (same run; chains of "
                    f"{', '.join(str(d) for d in best['compared'])} compared with "
                    f"{p.eval_depth}; docs/recipe.md says why it differs by machine)",
                )
            )
    if result.heldout_acceptance_length is not None:
        note = getattr(result, "heldout_speed_note", "")
        per_turn = f"; per turn {note}" if note else ""
        rows.append(
            (
                "held-out prompts",
                f"acceptance length {result.heldout_acceptance_length:.2f}, speed-up "
                f"{result.heldout_speedup:.2f}x ({result.profile.heldout_prompts} "
                f"ShareGPT conversations the draft never saw{per_turn})",
            )
        )
    tuned = getattr(result, "tune", None)
    if tuned:
        rows.append(("how to serve it (spec tune)", tune_text(tuned)))
    if result.eval_json is not None:
        rows.append(("eval report", str(result.eval_json)))
    if result.serve_command:
        rows.append(("serve with vLLM", result.serve_command))
    if tuned and tuned.get("speculative_config") and tuned.get("serve"):
        rows.append(("serve with vLLM, as tuned", tuned["serve"]))
    estimate = getattr(result, "estimate", None)
    estimated = f" (estimated {estimate['minutes']:g} min at the start" if estimate else ""
    if estimate and (estimate.get("busy") or {}).get("too_busy"):
        estimated += ", on a busy machine"
    if estimate and estimate.get("revised_minutes") is not None:
        estimated += f", {estimate['revised_minutes']:g} after regenerate"
    if estimate and estimate.get("paced_minutes") is not None:
        estimated += f", {estimate['paced_minutes']:g} at training's measured pace"
    estimated += ")" if estimate else ""
    profile = result.profile
    budget = f" of its {profile.minutes:g}" if getattr(profile, "minutes", 0) else ""
    rows.append(
        (
            "total",
            f"{result.seconds / 60:.1f} min{budget}{estimated}; rerun `spec demo` to reuse the "
            "finished stages",
        )
    )
    sizing = (estimate or {}).get("sizing")
    if sizing:  # what this run bought, and what more minutes would buy on this machine
        more = sizing["more"]
        rows.append(
            (
                "more minutes",
                f"this run: {profile.samples:,} answers, {profile.steps:,} steps; --minutes "
                f"{more['minutes']:g} buys {more['answers']:,} answers and {more['steps']:,} steps "
                "here (docs/recipe.md: acceptance against answers and steps)",
            )
        )
    summary(f"spec demo ({result.profile.name}) in {result.folder}", rows)


def tune_text(report: dict) -> str:
    """One paragraph of a serving.json: the fastest k at each batch size with its speed-up, and what is
    recommended."""
    rows = [r for r in report.get("table", []) if r.get("fastest")]
    if report.get("engine") == "vllm":
        sizes = ", ".join(f"batch {r['batch_size']}: k {r['k']} {r['speedup']:.2f}x" for r in rows)
        config = report.get("speculative_config")
        if config is None:
            advice = report.get("why", "")
        else:
            advice = "schedule " + json.dumps(config["num_speculative_tokens_per_batch_size"])
        return f"{sizes} over the target alone (vLLM); {advice}"
    r = rows[0] if rows else None
    return (
        f"batch 1 in PyTorch: {r['config']} {r['speedup']:.2f}x over the target alone"
        if r
        else report.get("why", "")
    )


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _line(text: str) -> None:
    console.print(text, markup=False, soft_wrap=True)  # paths and values are not rich markup


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"{path} is not readable JSON ({exc})", "pass a complete artifact folder"
        ) from exc
    return value if isinstance(value, dict) else {}


def _tensors(path: Path) -> tuple[dict, dict]:
    """(file metadata, {key: (shape, dtype)}) of a safetensors file, without reading the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as exc:
        raise ArtifactError(
            f"{path} is not a safetensors artifact ({exc})", "pass a file written by spec_cli"
        ) from exc
    return meta, shapes


def _print_tensors(shapes: dict, limit: int = 40) -> None:
    for key, (shape, dtype) in list(shapes.items())[:limit]:
        _line(f"  {key:40s} {dtype:6s} {list(shape)}")
    if len(shapes) > limit:
        _line(f"  ... and {len(shapes) - limit} more tensors")


def _inspect_checkpoint(path: Path) -> None:
    state = _read_json(path / "trainer_state.json")
    config = _read_json(path / "config.json")
    _, shapes = _tensors(path / "model.safetensors")
    _line(f"{path}  kind: draft_checkpoint  schema: {state.get('schema_version', '?')}")
    _line(f"  step: {state.get('step')}  epoch: {state.get('epoch')}")
    for key in (
        "target_architecture",
        "target_num_layers",
        "aux_layer_ids",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "draft_vocab_size",
        "fc_norm",
        "norm_output",
        "target_fingerprint",
    ):
        if key in config:
            _line(f"  {key}: {config[key]}")
    _line(f"  tensors: {len(shapes)} in model.safetensors")
    from spec_cli.artifacts import checkpoint as ckpt

    frozen = ckpt.checkpoint_meta(path).get("frozen")
    if frozen:
        where = next(
            (
                p
                for p in ckpt.frozen_candidates(path)
                if p.is_file() and ckpt.frozen_meta(p).get("fingerprint") == frozen["fingerprint"]
            ),
            None,
        )
        _line(
            f"  frozen (not in the checkpoint): {', '.join(frozen['keys'])}, fingerprint "
            f"{frozen['fingerprint']}, "
            + (
                f"in {where}"
                if where
                else "MISSING (not beside the checkpoint nor in its run folder)"
            )
        )
    else:
        _line("  frozen: in model.safetensors (a checkpoint from before frozen.safetensors)")


def _inspect_run(path: Path) -> None:
    from spec_cli.artifacts import checkpoint as ckpt

    options = _read_json(path / "run.json").get("options", {})
    checkpoints = ckpt.checkpoint_dirs(path)
    _line(f"{path}  kind: run")
    for key in ("target", "cache", "remote", "data", "vocab_map", "ttt_steps", "lr", "loss"):
        if options.get(key) is not None:
            _line(f"  {key}: {options[key]}")
    _line(
        f"  checkpoints: {', '.join(c.name for c in checkpoints) or 'none'}"
        + (f" ({human_bytes(sum(_folder_bytes(c) for c in checkpoints))})" if checkpoints else "")
    )
    frozen = path / ckpt.FROZEN
    if frozen.is_file():
        meta = ckpt.frozen_meta(frozen)
        _line(
            f"  frozen weights: {frozen.name} ({human_bytes(frozen.stat().st_size)}, "
            f"{', '.join(meta.get('keys', []))}, fingerprint {meta.get('fingerprint')}), once for all checkpoints"
        )
    evals, engine = [], []
    if (path / "log.jsonl").is_file():
        for line in (path / "log.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("split") == "eval":
                evals.append(record)
            elif record.get("split") == "engine" and "error" not in record:
                engine.append(record)
    if evals:
        last = evals[-1]
        acc = " ".join(f"{a:.3f}" for a in last.get("acc", []))
        _line(
            f"  last eval: step {last.get('step')}, accuracy per TTT step {acc}, simulated acceptance "
            f"length {last.get('acceptance_length', 0):.2f}"
        )
    if engine:
        _line(
            f"  engine ({engine[-1].get('engine')}) acceptance length: "
            + ", ".join(
                f"{r.get('acceptance_length', 0):.3f} @ {r.get('step')}" for r in engine[-8:]
            )
        )
    best = ckpt.best_record(path)
    if best:
        _line(
            f"  best: {path / ckpt.BEST} (step {best.get('step')}, acceptance length "
            f"{best.get('acceptance_length', 0):.3f} in {best.get('engine')}); export and eval take it"
        )


def _check_cache(path: Path, manifest: dict, verify: bool) -> None:
    """Sizes and shapes always (cheap); with --verify every shard's sha256 (exit 1 naming the damaged)."""
    from spec_cli.artifacts import feature_cache as fc

    try:
        fc.check_files(path, manifest)
    except ArtifactError:
        if not verify:
            raise
        damaged = fc.verify_shards(path, manifest)
        raise ArtifactError(
            f"the feature cache {path} is damaged: sizes or shapes differ from its manifest"
            + (f"; failing their checksums: {', '.join(damaged)}" if damaged else ""),
            fc.rebuild_hint(path, manifest),
        ) from None
    if verify:
        damaged = fc.verify_shards(path, manifest)
        if damaged:
            raise ArtifactError(
                f"the feature cache {path} is damaged: {', '.join(damaged)} "
                f"{'fails its checksum' if len(damaged) == 1 else 'fail their checksums'} "
                f"({len(damaged)} of {len(manifest.get('shards', []))} shards)",
                fc.rebuild_hint(path, manifest),
            )
        _line(f"{path}: all {len(manifest.get('shards', []))} shards match their checksums")


def _check_export_aux(path: Path, config: dict, shapes: dict) -> None:
    """A hand-edited aux layer list: fc.weight's input width must be n_aux x target_hidden_size."""
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    fc_shape = (shapes.get("fc.weight") or (None,))[0]
    if not aux or not fc_shape or len(fc_shape) != 2:
        return
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if not isinstance(aux, list) or not isinstance(hidden, int):
        raise ArtifactError(
            f"{path / 'config.json'}: eagle_aux_hidden_state_layer_ids {aux!r} or hidden size "
            f"{hidden!r} is malformed",
            "export the checkpoint again with `spec export`",
        )
    if fc_shape[1] != len(aux) * hidden:
        raise ArtifactError(
            f"{path / 'config.json'} lists {len(aux)} aux layers ({aux}), but fc.weight takes "
            f"{fc_shape[1]} inputs, not {len(aux)} x {hidden} = {len(aux) * hidden} (was the "
            "config edited?)",
            "export the checkpoint again with `spec export`",
        )


def _inspect_export(path: Path, config: dict) -> None:
    block = config.get("spec_cli") if isinstance(config.get("spec_cli"), dict) else {}
    _, shapes = _tensors(path / "model.safetensors")
    _check_export_aux(path, config, shapes)
    arch = (config.get("architectures") or ["?"])[0]
    _line(
        f"{path}  kind: draft_export  format: {block.get('format', 'unknown (not written by spec_cli)')}  "
        f"architecture: {arch}"
    )
    for key in (
        "step",
        "checkpoint",
        "target",
        "target_architecture",
        "aux_layer_outputs",
        "dtype",
    ):
        if key in block:
            _line(f"  {key}: {block[key]}")
    aux = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if aux is not None:
        _line(f"  aux layer ids as the engine counts them: {aux}")
    _print_tensors(shapes)


def _inspect_eval(path: Path) -> None:
    report = _read_json(path / "eval.json")
    s, o = report.get("settings", {}), report.get("overall", {})
    engine = report.get("engine") or {"name": s.get("engine", "torch")}
    _line(f"{path}  kind: eval  engine: {engine.get('name')} {engine.get('version', '')}".rstrip())
    _line(f"  draft: {report.get('draft', {}).get('path')}  target: {report.get('target')}")
    _line(
        f"  prompts: {s.get('prompts')} ({s.get('turns')} turns), depth {s.get('depth')}, top-k {s.get('topk')}, "
        f"temperature {s.get('temperature')}, {s.get('max_new_tokens')} new tokens"
    )
    rates = " ".join("-" if r is None else f"{r:.2f}" for r in o.get("acceptance_rate", []))
    _line(
        f"  acceptance length {o.get('acceptance_length', 0):.2f}, rate by position {rates}, speed-up "
        f"{o.get('speedup', 0):.2f}x, same output as the target {o.get('same_as_target')}/{o.get('turns')}"
        + (f" (+{o['parted_at_tie']} parted at a rounding tie)" if o.get("parted_at_tie") else "")
    )
    if s.get("threads"):
        from spec_cli.eval.report import spread_text

        spread = spread_text(o.get("speedup_spread"))
        _line(
            f"  timing: {s['threads']} thread(s) ({s.get('threads_reason')}), {s.get('timing_repeats', 1)} "
            f"run(s) per turn and decoder" + (f"; per-turn speed-up {spread}" if spread else "")
        )
    if (report.get("busy") or {}).get("warning"):
        _line(f"  WARNING: {report['busy']['warning']}")
    for name, m in sorted(report.get("categories", {}).items()):
        _line(
            f"  {name:12s} acceptance length {m.get('acceptance_length', 0):.2f}  speed-up {m.get('speedup', 0):.2f}x"
        )


def inspect_artifact(path: Path, verify: bool = False) -> None:
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path} does not exist", "check the path")
    if path.is_dir():
        if (path / "manifest.json").is_file():
            manifest = _read_json(path / "manifest.json")
            if manifest.get("kind") == "feature_cache":
                _check_cache(path, manifest, verify)
            _line(f"{path}  kind: {manifest.get('kind')}  schema: {manifest.get('schema_version')}")
            for key, value in sorted(manifest.items()):
                if key != "shards":
                    _line(f"  {key}: {value}")
            shards = manifest.get("shards", [])
            _line(f"  shards: {len(shards)} files, {sum(s['bytes'] for s in shards)} bytes")
            return
        shards = sorted(path.glob("shard-*.safetensors"))
        if shards and not (path / "manifest.json").is_file():
            raise ArtifactError(
                f"{path} is an unfinished feature cache ({len(shards)} shard(s) written, no "
                "manifest.json yet)",
                "rerun the same `spec precompute` command to finish it (it "
                "keeps the shards it verifies)",
            )
        if (path / "trainer_state.json").is_file():
            return _inspect_checkpoint(path)
        if (path / "run.json").is_file():
            return _inspect_run(path)
        if (path / "eval.json").is_file():
            return _inspect_eval(path)
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return _inspect_export(path, _read_json(path / "config.json"))
        raise ArtifactError(
            f"{path} is a folder spec_cli does not know",
            "pass a vocab map, feature cache, run, checkpoint, export or eval folder",
        )
    if (
        path.name == "model.safetensors"
        and (path.parent / "config.json").is_file()
        and not (path.parent / "trainer_state.json").is_file()
    ):
        return _inspect_export(path.parent, _read_json(path.parent / "config.json"))
    if path.name == "eval.json":
        return _inspect_eval(path.parent)
    file_meta, shapes = _tensors(path)
    try:
        meta = json.loads(file_meta.get("spec_cli", "{}"))
    except ValueError:
        meta = {}
    _line(f"{path}  kind: {meta.get('kind', 'unknown')}  schema: {meta.get('schema_version', '?')}")
    _print_tensors(shapes)
    if "coverage_by_size" in meta:
        _line(f"  coverage by Vd: {_coverage(meta['coverage_by_size'])}")
    for key, value in sorted(meta.items()):
        if key != "coverage_by_size":
            _line(f"  {key}: {value}")
