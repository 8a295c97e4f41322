"""The race: EAGLE-3 drafts for SmolLM2-135M-Instruct from spec_cli and from its peers, trained on the
same data for the same minutes (and, apart, for the same tokens), each saved by its own tool and
served by vLLM from the folder that tool wrote.

    spec demo                      # (or spec demo --quick) makes the data, vocab map and feature cache
    python bench/race.py --demo ~/.cache/spec_cli/demo/full --out /tmp/race --minutes 5,15 \
        --tokens auto --seeds 0,1

Contestants (--contestants; the peers' modules say what each needed on a CPU):
- spec        `spec train` at its defaults (spec_cli/train_options.py), exported by `spec export`;
- spec-demo   `spec train` with the demo's recipe (spec_cli/stages/demo PROFILES["full"]), without
              the demo's engine-picked checkpoint (the race takes the last one, as for every other);
- speculators bench/race_speculators.py: speculators 0.9.0's EAGLE-3 model, loss, Muon and schedule;
- speculators-2k  the same with packed rows of 2,048 tokens instead of 8,192: on a CPU its attention
              runs as SDPA over a dense document mask whose cost grows with the row's square
              (8,192-token rows train at a third of 2,048-token rows' tokens/s here), where its
              CUDA default, flex attention, skips the masked blocks;
- specforge   bench/race_specforge.py: SpecForge 0.2.0's;
- nemo        bench/race_nemo.py: NeMo AutoModel 0.7.0's `train_eagle3` recipe's;
- spec+LEVER[+LEVER...]  `spec train` at its defaults with recipe levers changed (LEVERS below: pack,
              bt2048, ttt3, lr1e-3, wsd, fcnorm, ...), each lever measured alone at equal minutes.

The same for all: the demo's feature cache (bench/race_data.py: the same token ids, loss masks, aux
states and target distributions, its draft vocab map), a one-layer draft, this machine, one
contestant at a time. A time budget of M minutes: each contestant's seconds per step are measured
first (a few steps, thrown away), its schedule is set over the steps M minutes hold, and training
stops at M minutes whatever the step. spec_cli's seconds per step are the wall clock's: two short
runs, their difference over the difference of their steps (start-up and the last save cancel).
A token budget: the steps that hold that many tokens of rows.

Measured the same way: vLLM (this process, fp32, greedy) serves each folder with a chain of --chain
tokens; acceptance is vLLM's pooled figure, 1 + accepted / drafts, with the per-request mean beside
it (what SpecForge reports), on the first turns of --mt-bench MT-bench questions and of --heldout
ShareGPT conversations after the last one the demo trained on, --max-new-tokens each, all requests
of a set in one batch (acceptance does not depend on the batch); and output tokens/s with one
request at a time on the first --batch1 MT-bench prompts, over the target alone's on the same ones.

Finished runs and evaluations are kept in OUT (runs/<name>/result.json, eval-*.json) and reused: a
rerun adds what is missing. OUT/race.json holds every number, the versions and the command;
OUT/race.png plots acceptance against training minutes per trainer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from race_data import Feed  # noqa: E402

from spec_cli.artifacts.io import write_json  # noqa: E402
from spec_cli.console import set_quiet  # noqa: E402

CONTESTANTS = ("spec", "spec-demo", "speculators", "speculators-2k", "specforge", "nemo")
# spec+<lever>: one `spec train` option changed from its default (the demo's recipe, lever by lever)
LEVERS = {
    "pack": dict(pack=True),
    "bt2048": dict(batch_tokens=2048),
    "bt4096": dict(batch_tokens=4096),
    "ttt3": dict(ttt_steps=3),
    "ttt5": dict(ttt_steps=5),
    "lr5e-4": dict(lr=5e-4),
    "lr1e-3": dict(lr=1e-3),
    "wsd": dict(schedule="wsd"),
    "fcnorm": dict(fc_norm=True),
    "muon": dict(optimizer="muon"),
}
PEER_MODULES = {
    "speculators": "race_speculators",
    "speculators-2k": "race_speculators",
    "specforge": "race_specforge",
    "nemo": "race_nemo",
}


# ----------------------------------------------------------------------------- spec_cli's contestants


class SpecCli:
    """`spec train` from the cache (its own loop, optimizer and schedule), exported by `spec export`."""

    def __init__(self, name: str, vocab_map: Path):
        from spec_cli import __version__
        from spec_cli.stages.demo import PROFILES

        self.NAME, self.VERSION, self.vocab_map = name, __version__, vocab_map
        full = PROFILES["full"]
        if name.startswith("spec+"):
            self.options = {}
            for lever in name.split("+")[1:]:
                if lever not in LEVERS:
                    raise SystemExit(f"{name}: no lever {lever!r} (levers: {', '.join(LEVERS)})")
                self.options.update(LEVERS[lever])
            return
        self.options = (
            {}
            if name == "spec"
            else dict(
                pack=True,
                batch_tokens=full.batch_tokens,
                ttt_steps=full.ttt_steps,
                lr=full.lr,
                fc_norm=True,
                schedule=full.schedule,
                optimizer=full.optimizer,
            )
        )

    def settings(self) -> dict:
        from spec_cli.train_options import TrainConfig

        o = TrainConfig.from_options(cache="-", vocab_map="-", output="-", **self.options).options()
        keys = (
            "optimizer lr schedule warmup_ratio decay_ratio weight_decay grad_clip ttt_steps "
            "step_weight pack batch_tokens max_length fc_norm"
        ).split()
        return {k: o.get(k) for k in keys}

    def adaptations(self) -> list[str]:
        return [
            "--eval-fraction 0 (every contestant trains on all rows); no engine in the loop: the "
            "last checkpoint is exported"
        ]

    def _run(self, feed_cache: Path, out: Path, steps: int, max_seconds, seed: int) -> Path:
        from spec_cli.stages import train

        train.run(
            train.TrainConfig.from_options(
                cache=str(feed_cache),
                vocab_map=str(self.vocab_map),
                output=out,
                max_steps=steps,
                max_time=max_seconds,
                seed=seed,
                eval_fraction=0,
                log_every=1,
                eval_every=10**9,
                save_every=10**9,
                **self.options,
            )
        )
        return out

    @staticmethod
    def _log(run: Path) -> list[dict]:
        lines = (run / "log.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("split") == "train"]

    def step_seconds(self, cache: Path, scratch: Path, seed: int = 0) -> float:
        """Wall-clock seconds per step: runs of 4 and 20 steps, the difference of their wall times
        over 16 (the log's per-window rates leave out the time between windows: the median of 8
        steps' rates planned 347 steps into 5 minutes that held 317)."""
        import shutil

        walls = {}
        for steps in (4, 20):
            shutil.rmtree(scratch, ignore_errors=True)
            start = time.perf_counter()
            self._run(cache, scratch, steps, None, seed)
            walls[steps] = time.perf_counter() - start
        shutil.rmtree(scratch, ignore_errors=True)
        return (walls[20] - walls[4]) / 16

    def train(self, cache: Path, out: Path, total_steps: int, max_seconds, seed: int) -> dict:
        from spec_cli.cli import main

        run = out / "run"
        start = time.perf_counter()
        self._run(cache, run, total_steps, max_seconds, seed)
        seconds = time.perf_counter() - start
        records = self._log(run)
        export = out / "vllm"
        code = main(["export", str(run), "--format", "vllm", "--engine-check", "none",
                     "-o", str(export), "-q"])  # fmt: skip
        if code != 0:
            raise SystemExit(f"spec export of {run} failed ({code})")
        return {
            "steps": records[-1]["step"] if records else 0,
            "tokens": sum(r["tokens"] for r in records),
            "seconds": seconds,  # the run's wall time, start-up included (the peers' counts less)
            "train_seconds": sum(r["tokens"] / r["tokens_per_s"] for r in records),
            "folder": str(export),
            "num_speculative_tokens": None,
            "losses": [r["loss"] for r in records[:: max(1, len(records) // 8)]],
        }


# ----------------------------------------------------------------------------- the budgets


def contestant(name: str, vocab_map: Path):
    if name in ("spec", "spec-demo") or name.startswith("spec+"):
        return SpecCli(name, vocab_map)
    peer = importlib.import_module(PEER_MODULES[name])
    if name == "speculators-2k":
        return _ShortRows(peer, name, 2048)
    return peer


class _ShortRows:
    """A peer module with its packed rows cut to `row_tokens` (a CPU adaptation; see the docstring)."""

    def __init__(self, peer, name: str, row_tokens: int):
        self.peer, self.NAME, self.VERSION = peer, name, peer.VERSION
        self.ROWS = (peer.ROWS[0], row_tokens)

    def settings(self) -> dict:
        return {**self.peer.settings(), "rows": f"packed, {self.ROWS[1]} tokens (race adaptation)"}

    def adaptations(self) -> list[str]:
        return self.peer.adaptations() + [
            f"rows: packed to {self.ROWS[1]} tokens, not {self.peer.ROWS[1]}: on a CPU its SDPA "
            "attention over a dense document mask costs the row's square"
        ]

    def step_seconds(self, feed) -> float:
        return self.peer.step_seconds(feed)

    def train(self, feed, out: Path, total_steps: int, max_seconds, seed: int) -> dict:
        return self.peer.train(feed, out, total_steps, max_seconds, seed)


def feed_for(c, cache: Path, seed: int) -> Feed | None:
    """The peer's rows (its ROWS); spec_cli's contestants read the cache themselves."""
    if isinstance(c, SpecCli):
        return None
    rows, tokens = c.ROWS
    return Feed(cache, rows=rows, row_tokens=tokens, seed=seed)


def seconds_per_step(c, cache: Path, out: Path) -> float:
    """Measured once per contestant and kept in OUT/probe-<name>.json."""
    path = out / f"probe-{c.NAME}.json"
    if path.is_file():
        return json.loads(path.read_text())["seconds_per_step"]
    if isinstance(c, SpecCli):
        s = c.step_seconds(cache, out / f"probe-{c.NAME}")
    else:
        s = c.step_seconds(feed_for(c, cache, 0))
    write_json(path, {"seconds_per_step": s})
    return s


def steps_for_tokens(c, cache: Path, tokens: int) -> int:
    """Steps whose rows hold `tokens` tokens (rows of epoch 0's order; spec_cli's: its batch plan)."""
    if isinstance(c, SpecCli):
        from spec_cli.train_options import TrainConfig
        from spec_cli.trainer.sources import _cache_source

        cfg = TrainConfig.from_options(cache=str(cache), vocab_map=str(c.vocab_map), output="-",
                                       **c.options)  # fmt: skip
        from spec_cli.artifacts.vocab_map import load_vocab_map

        source = _cache_source(cfg, torch.device("cpu"), load_vocab_map(c.vocab_map))
        per_row = [int(sum(source.tokens.lengths[i] for i in b)) for b in source.plan]
    else:
        feed = feed_for(c, cache, 0)
        per_row = [feed.row_tokens_of(i) for i in range(len(feed))]
    mean = sum(per_row) / len(per_row)
    return max(1, math.ceil(tokens / mean))


def run_one(c, cache: Path, out: Path, kind: str, value: float, seed: int) -> dict:
    """Train one run (or read its result.json). The draft's folder is kept relative to the run's, so
    OUT's JSON files alone (what bench/race-results keeps in git) let a rerun skip finished runs."""
    folder = out / "runs" / f"{c.NAME}-{kind}{value:g}-s{seed}"
    done = folder / "result.json"
    if done.is_file():
        result = json.loads(done.read_text())
        result["folder"] = str(folder / result["folder"])
        return {**result, "run": str(folder)}
    if kind == "min":
        per_step = seconds_per_step(c, cache, out)
        steps, cap = max(1, int(value * 60 / per_step)), value * 60
    else:
        steps, cap = steps_for_tokens(c, cache, int(value)), None
    print(f"== {c.NAME}: {kind} {value:g}, seed {seed}: {steps} steps", flush=True)
    torch.manual_seed(seed)
    if isinstance(c, SpecCli):
        result = c.train(cache, folder, steps, cap, seed)
    else:
        result = c.train(feed_for(c, cache, seed), folder, steps, cap, seed)
    result.update(
        contestant=c.NAME, version=c.VERSION, budget=kind, value=value, seed=seed,
        planned_steps=steps, settings=c.settings(), adaptations=c.adaptations(),
    )  # fmt: skip
    write_json(done, {**result, "folder": str(Path(result["folder"]).relative_to(folder))})
    return {**result, "run": str(folder)}


# ----------------------------------------------------------------------------- served acceptance


def prompt_sets(demo: Path, target: Path, mt_bench: int, heldout: int) -> dict[str, list]:
    """{"mt-bench": [ids], "heldout": [ids]}: first user turns, as the target's chat template renders them."""
    from spec_cli import assets
    from spec_cli.eval import prompts
    from spec_cli.paths import spec_home
    from spec_cli.stages.demo import _last_source_index, _sharegpt_after
    from spec_cli.targets import loading

    tokenizer = loading.load_tokenizer(target)
    found = assets.installed(spec_home())
    mt = prompts.load_conversations("mt-bench")[:mt_bench]
    trained = (
        demo / "train.jsonl" if (demo / "train.jsonl").is_file() else demo / "regenerated.jsonl"
    )
    held = [
        prompts.Conversation(id=str(r["source_index"]), turns=[r["messages"][-1]["content"]])
        for r in _sharegpt_after(found, _last_source_index(trained), heldout, keep_users=1)
    ]
    return {
        "mt-bench": [prompts.prompt_ids(tokenizer, c, 0) for c in mt],
        "heldout": [prompts.prompt_ids(tokenizer, c, 0) for c in held],
    }


def batch1(engine, ids: list[list[int]], max_new_tokens: int, eos) -> dict:
    """Output tokens/s with one request at a time (after one unmeasured request)."""
    engine.generate(ids[0], 8, 0.0, eos)
    tokens, seconds = 0, 0.0
    for p in ids:
        g = engine.generate(p, max_new_tokens, 0.0, eos)
        tokens, seconds = tokens + len(g.tokens), seconds + g.seconds
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "requests": len(ids)}


def served(
    target: Path,
    folder: Path | None,
    sets: dict,
    depth: int,
    max_new_tokens: int,
    b1: list[list[int]] | None = None,
) -> dict:
    """vLLM's acceptance for each prompt set (`sets`, may be empty): pooled (1 + accepted / drafts)
    and the per-request mean; and output tokens/s at batch 1 on the prompts `b1` (None: not
    measured). No folder: the target alone."""
    from spec_cli.engine import vllm
    from spec_cli.eval.speculative import eos_ids
    from spec_cli.targets import loading

    eos = eos_ids(loading.load_tokenizer(target), loading.generation_config(target))
    longest = max(len(p) for ids in [*sets.values(), b1 or []] for p in ids)
    out = {}
    with vllm.Engine(
        target, folder, depth, torch.float32, longest + max_new_tokens + depth + 8
    ) as e:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False,
                                stop_token_ids=sorted(eos))  # fmt: skip
        if b1:
            out["batch1"] = batch1(e, b1, max_new_tokens, eos)
        for name, ids in sets.items() if folder is not None else ():
            start = time.perf_counter()
            outs = e.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
            accepted, drafts, per_request = 0, 0, []
            for o in outs:
                m = o.outputs[0].spec_decode_metrics  # per request ("detailed", Engine asks)
                a, d = sum(m.per_step_accepted), len(m.per_step_accepted)
                accepted, drafts = accepted + a, drafts + d
                if d:
                    per_request.append(1 + a / d)
            out[name] = {
                "acceptance_length": 1 + accepted / max(drafts, 1),
                "per_request_mean": statistics.mean(per_request) if per_request else None,
                "requests": len(ids),
                "drafts": drafts,
                "accepted": accepted,
                "seconds": time.perf_counter() - start,
            }
    return out


def evaluate(result: dict, out: Path, target: Path, sets: dict, args) -> dict:
    """The served figures of one run, kept in its run folder and reused: acceptance in
    eval-chain<k>.json, tokens/s at batch 1 in batch1-chain<k>.json."""
    depth, folder, run = args.chain, Path(result["folder"]), Path(result["run"])
    acceptance = run / f"eval-chain{depth}.json"
    speed = run / f"batch1-chain{depth}.json"
    todo_sets = {} if acceptance.is_file() else sets
    todo_b1 = sets["mt-bench"][: args.batch1] if args.batch1 and not speed.is_file() else None
    if todo_sets or todo_b1:
        got = served(target, folder, todo_sets, depth, args.max_new_tokens, todo_b1)
        if todo_b1:
            write_json(speed, {"batch1": got.pop("batch1")})
        if todo_sets:
            write_json(acceptance, got)
    got = json.loads(acceptance.read_text())
    if speed.is_file():
        got.update(json.loads(speed.read_text()))
    return got


def alone(out: Path, target: Path, sets: dict, args) -> dict | None:
    """The target alone at batch 1 on the same prompts: the baseline of the speedups."""
    if not args.batch1:
        return None
    path = out / "target-alone.json"
    if not path.is_file():
        b1 = sets["mt-bench"][: args.batch1]
        write_json(path, served(target, None, {}, 0, args.max_new_tokens, b1))
    return json.loads(path.read_text())["batch1"]


# ----------------------------------------------------------------------------- the table


def table(rows: list[dict], base: dict | None = None) -> str:
    """The race as markdown; `base`: the target alone at batch 1 (speedup = tokens/s over it)."""
    head = (
        "| trainer | budget | seed | steps | tokens | train tok/s | MT-bench AL (per request) "
        "| held-out AL (per request) | batch-1 speedup |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        e = r["eval"]
        b1 = e.get("batch1")  # measured on the same prompts as base
        speedup = f"{b1['tokens_per_s'] / base['tokens_per_s']:.2f}x" if b1 and base else "-"
        budget = f"{r['value']:g} min" if r["budget"] == "min" else f"{int(r['value']):,} tokens"
        secs = r.get("train_seconds") or r["seconds"]
        lines.append(
            f"| {r['contestant']} {r['version']} | {budget} | {r['seed']} | {r['steps']} "
            f"| {r['tokens']:,} | {r['tokens'] / max(secs, 1e-9):.0f} "
            f"| {e['mt-bench']['acceptance_length']:.3f} ({e['mt-bench']['per_request_mean']:.3f}) "
            f"| {e['heldout']['acceptance_length']:.3f} ({e['heldout']['per_request_mean']:.3f}) "
            f"| {speedup} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """Acceptance against training minutes per trainer (the mean over seeds), MT-bench and
    held-out side by side; False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [r for r in rows if r["budget"] == "min"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, prompts in zip(axes, ("mt-bench", "heldout")):
        for name in dict.fromkeys(r["contestant"] for r in timed):
            by_minutes: dict[float, list[float]] = {}
            for r in timed:
                if r["contestant"] == name:
                    al = r["eval"][prompts]["acceptance_length"]
                    by_minutes.setdefault(r["value"], []).append(al)
            xs = sorted(by_minutes)
            ax.plot(xs, [statistics.mean(by_minutes[x]) for x in xs], marker="o", label=name)
        ax.set_title(f"{prompts} (vLLM, chain 3)")
        ax.set_xlabel("training minutes")
    axes[0].set_ylabel("acceptance length")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _cpu() -> str:
    """The CPU's model name (what a stated duration names), from /proc/cpuinfo where there is one."""
    import platform

    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", type=Path, required=True, help="a spec demo folder (its cache)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", default="5,15", help="time budgets, comma-separated")
    ap.add_argument("--tokens", default="auto", help="a token budget; auto: what `spec` trained in "
                    "the smallest time budget; 0: none")  # fmt: skip
    ap.add_argument("--seeds", default="0", help="seeds; those after the first run at the largest "
                    "time budget only")  # fmt: skip
    ap.add_argument("--contestants", default=",".join(CONTESTANTS))
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--mt-bench", type=int, default=80)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch1", type=int, default=8, help="MT-bench prompts decoded one at a time "
                    "for tokens/s at batch 1 (and the target alone's); 0: none")  # fmt: skip
    args = ap.parse_args()
    set_quiet(True)
    demo, out = args.demo.expanduser().resolve(), args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = demo / "cache"
    (vocab_map,) = sorted(demo.glob("vocab-*.safetensors"))
    target = Path(json.loads((cache / "manifest.json").read_text())["target"])
    minutes = [float(m) for m in args.minutes.split(",") if m]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    names = [n for n in args.contestants.split(",") if n]
    from spec_cli.engine import vllm

    contestants = [contestant(n, vocab_map) for n in names]
    started = time.time()

    sets = prompt_sets(demo, target, args.mt_bench, args.heldout)
    base = alone(out, target, sets, args)
    plan = [(c, "min", m, seeds[0]) for m in minutes for c in contestants]
    plan += [(c, "min", max(minutes), s) for s in seeds[1:] for c in contestants]
    invocation = {
        "command": "python bench/race.py " + " ".join(map(shlex.quote, sys.argv[1:])),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        "vllm": vllm.version(),
        "torch": torch.__version__,
    }
    done: list[dict] = []

    def race(c, kind: str, value: float, seed: int) -> None:
        """Train (or reuse) one run, serve it, and rewrite OUT/race.json and the plot."""
        r = run_one(c, cache, out, kind, value, seed)
        e = evaluate(r, out, target, sets, args)
        done.append(r)
        print(f"-- {c.NAME} {kind} {value:g} seed {seed}: MT-bench "
              f"{e['mt-bench']['acceptance_length']:.3f}, held-out "
              f"{e['heldout']['acceptance_length']:.3f}", flush=True)  # fmt: skip
        record(out, args.chain, {**invocation, "seconds": time.time() - started}, base)

    for step in plan:
        race(*step)
    tokens = args.tokens
    if tokens == "auto":
        ours = [r for r in done if r["contestant"] == names[0] and r["value"] == min(minutes)]
        tokens = ours[0]["tokens"] if ours else 0
    for c in contestants if int(tokens) else ():
        race(c, "tok", int(tokens), seeds[0])
    print(record(out, args.chain, {**invocation, "seconds": time.time() - started}, base))
    print(f"race.json and race.png in {out}")


def collected(out: Path, chain: int) -> list[dict]:
    """Every run in OUT that has been served, whichever command ran it: time budgets by minutes,
    then token budgets, each seed by seed, contestants in CONTESTANTS' order."""
    rows = []
    for done in sorted((out / "runs").glob("*/result.json")):
        acceptance = done.parent / f"eval-chain{chain}.json"
        if not acceptance.is_file():
            continue
        row = json.loads(done.read_text())
        row["eval"] = json.loads(acceptance.read_text())
        speed = done.parent / f"batch1-chain{chain}.json"
        if speed.is_file():
            row["eval"].update(json.loads(speed.read_text()))
        rows.append(row)
    order = {n: i for i, n in enumerate(CONTESTANTS)}  # then spec+<levers>, by name
    rows.sort(
        key=lambda r: (
            r["budget"] != "min", r["value"], r["seed"],
            order.get(r["contestant"], len(order)), r["contestant"],
        )
    )  # fmt: skip
    return rows


def record(out: Path, chain: int, invocation: dict, base: dict | None) -> str:
    """OUT/race.json (every served run, and each command that added to OUT with its machine and
    time) and OUT/race.png; returns the table."""
    path = out / "race.json"
    before = json.loads(path.read_text()).get("invocations", []) if path.is_file() else []
    invocations = [i for i in before if i["started"] != invocation["started"]] + [invocation]
    rows = collected(out, chain)
    text = table(rows, base)
    write_json(
        path,
        {"invocations": invocations, "target_alone_batch1": base, "rows": rows, "table": text},
    )
    plot(rows, out / "race.png")
    return text


if __name__ == "__main__":
    main()
