"""What `spec eval` measured, summed per category: acceptance, tokens/s of both decoders, speed-up.

acceptance length      tokens produced per target forward of the speculative loop (the accepted
                       drafts + the target's own token), over all such forwards
acceptance rate at j   P(draft position j accepted | positions 1..j-1 accepted): of the forwards in
                       which position j was verified on the accepted path, the share that accepted it
                       (tree: position = depth)
tokens/s               new tokens / wall time of the whole generation (prefill included), for the
                       speculative decoder and for the target alone on the same prompts
speed-up               speculative tokens/s / the target's, over all turns (each turn's median time
                       when it was timed more than once)
per-turn spread        the same ratio for each turn alone: median, quartiles, min and max; a wide
                       spread means the total rests on a few turns (or on a noisy machine)
same as target         greedy: turns whose speculative output equals the target's token for token
parted at a tie        greedy: of the others, those whose first differing token had a logit
                       within rounding of the target's choice there (see `parting`): a
                       verification of several tokens rounds differently from one-token decoding,
                       which in bf16 flips such ties; fp32 decodes identically
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from spec_cli.eval.speculative import ACCEPTANCE_RULES, Generation


@dataclass
class Tally:
    positions: int = 0  # draft positions reported (--depth); more are added if reached
    turns: int = 0
    steps: int = 0  # target forwards in the speculative loops
    produced: int = 0  # tokens those forwards produced
    accepted: list[int] = field(default_factory=list)  # [j-1]: forwards that accepted position j
    verified: list[int] = field(
        default_factory=list
    )  # [j-1]: forwards that verified position j on the path
    predicted: list[float] = field(
        default_factory=list
    )  # [j-1]: the draft's confidences summed over those
    spec_tokens: int = 0
    spec_seconds: float = 0.0
    draft_seconds: float = 0.0  # of spec_seconds, the draft's (PyTorch loop; 0 from vLLM)
    target_tokens: int = 0
    target_seconds: float = 0.0
    same_as_target: int = 0  # greedy: turns whose output equals the target's token for token
    parted_at_tie: int = (
        0  # greedy: turns that part from it at a rounding tie of its logits (`parting`)
    )
    parted_not_tie: int = 0  # ... and where its logits do not tie (not rounding)
    tie_margins: list[float] = field(default_factory=list)  # the margins at those ties
    ratios: list[float] = field(default_factory=list)  # each turn's speed-up (tokens on both sides)
    by_depth: dict[int, Tally] = field(
        default_factory=dict
    )  # the same turns as chains of other depths

    def add(self, spec: Generation, base: Generation | None, parted: dict | None = None) -> None:
        self.turns += 1
        self.spec_tokens += len(spec.tokens)
        self.spec_seconds += spec.seconds
        self.draft_seconds += spec.draft_seconds
        for m, v in spec.steps:
            self.steps += 1
            self.produced += m + 1
            while len(self.verified) < max(v, self.positions):
                self.verified.append(0)
                self.accepted.append(0)
            for j in range(v):
                self.verified[j] += 1
                self.accepted[j] += int(j < m)
        for row in spec.confidence:  # (one per step, of its verified positions)
            self.predicted += [0.0] * (len(row) - len(self.predicted))
            for j, c in enumerate(row):
                self.predicted[j] += c
        if base is not None:
            self.target_tokens += len(base.tokens)
            self.target_seconds += base.seconds
            self.same_as_target += int(base.tokens == spec.tokens)
            if parted is not None and parted["tie"]:
                self.parted_at_tie += 1
                self.tie_margins.append(parted["margin"])
            elif parted is not None and parted["tie"] is False:
                self.parted_not_tie += 1
            ratio = turn_speedup(spec, base)
            if ratio is not None:
                self.ratios.append(ratio)

    def metrics(self) -> dict:
        spec_tps = self.spec_tokens / self.spec_seconds if self.spec_seconds else 0.0
        target_tps = self.target_tokens / self.target_seconds if self.target_seconds else 0.0
        return {
            "turns": self.turns,
            "acceptance_length": self.produced / self.steps if self.steps else 0.0,
            "acceptance_rate": [a / v if v else None for a, v in zip(self.accepted, self.verified)],
            "accepted": list(self.accepted),
            # the confidence head's mean P(accepted | earlier accepted) where acceptance_rate was measured
            "predicted_acceptance": [
                self.predicted[j] / v if j < len(self.predicted) and v else None
                for j, v in enumerate(self.verified)
            ]
            if self.predicted
            else None,
            "verified": list(self.verified),
            "target_forwards": self.steps,
            "tokens_produced": self.produced,
            "spec_tokens": self.spec_tokens,
            "spec_seconds": round(self.spec_seconds, 4),
            "spec_tokens_per_s": spec_tps,
            # drafting time per draft-verify cycle (catch-up on the verified tokens + the proposal)
            "draft_ms_per_cycle": 1000 * self.draft_seconds / self.steps
            if self.draft_seconds and self.steps
            else None,
            "draft_share": self.draft_seconds / self.spec_seconds
            if self.draft_seconds and self.spec_seconds
            else None,
            "target_tokens": self.target_tokens,
            "target_seconds": round(self.target_seconds, 4),
            "target_tokens_per_s": target_tps,
            "speedup": spec_tps / target_tps if target_tps else 0.0,
            "same_as_target": self.same_as_target,
            "parted_at_tie": self.parted_at_tie,
            "parted_not_tie": self.parted_not_tie,
            "largest_tie_margin": max(self.tie_margins) if self.tie_margins else None,
            "speedup_spread": spread(self.ratios),
        }


TIE_ULPS = 8  # a margin within this many units in the last place of the logit is rounding
TIE_FLOOR = (
    1e-3  # ... or within this much (fp32's ulps are tiny; 30 layers add more than 8 of them)
)


def parting(spec: Generation, base: Generation, eps: float) -> dict | None:
    """Where a greedy speculative output first differs from the target's own; None where they are equal.
    -> {"at": index, "target": its token, "spec": ours, "margin": its logit minus ours there (None: ours
    was not among its TOP_LOGITS best), "tie": the margin is within rounding, i.e. <= max(TIE_ULPS * eps
    * |logit|, TIE_FLOOR), eps: the model dtype's machine epsilon; None where the target's decoder kept
    no logits (vLLM)}. Equal logits count as a tie whichever of them argmax took."""
    if spec.tokens == base.tokens:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(spec.tokens, base.tokens)) if a != b),
        min(len(spec.tokens), len(base.tokens)),
    )
    ours = spec.tokens[at] if at < len(spec.tokens) else None
    theirs = base.tokens[at] if at < len(base.tokens) else None
    margin, tie = None, (False if base.top else None)
    logits = base.top[at] if at < len(base.top) else {}
    if ours in logits and theirs in logits:
        margin = logits[theirs] - logits[ours]
        tie = margin <= max(TIE_ULPS * eps * abs(logits[theirs]), TIE_FLOOR)
    return {"at": at, "target": theirs, "spec": ours, "margin": margin, "tie": tie}


def identity_text(overall: dict, dtype: str) -> str:
    """The line on greedy outputs: how many equal the target's, and how the others part from it."""
    same, turns, ties = overall["same_as_target"], overall["turns"], overall.get("parted_at_tie", 0)
    text = f"greedy outputs identical to the target's: {same}/{turns} turns"
    if ties:
        text += (
            f"; {ties} more part from it where its logit for our token ties its choice within {dtype} "
            f"rounding (margin <= {overall['largest_tie_margin']:.3g}): a verification of several tokens "
            "rounds differently from one-token decoding (fp32 decodes identically)"
        )
    other = overall.get("parted_not_tie", 0)
    if other:
        text += (
            f"; WARNING: {other} part from it where its logits do not tie (outputs.jsonl: "
            "parted_at): not rounding"
        )
    return text


def rule_text(settings: dict, engine: str) -> str:
    """The line saying how the drafts were proposed and accepted (settings: eval.json's)."""
    name = settings.get("acceptance_rule")
    if name is None:  # an eval.json from before the rule was recorded
        return f"decoding rule: not recorded ({engine})"
    what = ACCEPTANCE_RULES.get(name, "vLLM's own rejection method, which spec_cli does not run")
    return f"decoding rule ({engine}): {settings['draft_sampling']} drafts, {name}: {what}"


def turn_speedup(spec: Generation, base: Generation) -> float | None:
    """One turn's speed-up: its speculative tokens/s over the target's (None without tokens or time)."""
    if not (spec.tokens and base.tokens and spec.seconds > 0 and base.seconds > 0):
        return None
    return (len(spec.tokens) / spec.seconds) / (len(base.tokens) / base.seconds)


def spread(values: list[float]) -> dict | None:
    """Median, quartiles (linear interpolation, as numpy.percentile), min and max of `values`."""
    if not values:
        return None
    q1, median, q3 = (
        statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    )
    return {
        "turns": len(values),
        "median": median,
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
    }


def spread_text(s: dict | None) -> str:
    """ "median 1.40x, middle half 1.31-1.55x, range 1.10-1.90x over 8 turns" ("" without a spread)."""
    if not s:
        return ""
    return (
        f"median {s['median']:.2f}x, middle half {s['q1']:.2f}-{s['q3']:.2f}x, range "
        f"{s['min']:.2f}-{s['max']:.2f}x over {s['turns']} turn{'s' if s['turns'] != 1 else ''}"
    )


# ----------------------------------------------------------------------------- output


def print_table(result) -> None:
    """The per-category table, the acceptance by position, how the speed was timed, and a WARNING when
    the machine was too busy for it (rich)."""
    from rich.table import Table
    from rich.text import Text

    from spec_cli.console import console, is_quiet

    if is_quiet():
        return
    s = result.settings
    shape = (
        f"chain of {s['depth']}"
        if s["topk"] == 1
        else f"tree depth {s['depth']}, top-{s['topk']}, {s['num_tokens']} nodes"
    )
    mode = "greedy" if s["temperature"] == 0 else f"sampling T={s['temperature']:g}"
    table = Table(
        title=Text(f"spec eval: {result.draft} on {result.target_name} ({shape}, {mode})"),
        title_justify="left",
    )  # a path in the title: wrapped, and not read as rich markup
    for name, justify in (
        ("category", "left"),
        ("turns", "right"),
        ("accept len", "right"),
        ("spec tok/s", "right"),
        ("target tok/s", "right"),
        ("speed-up", "right"),
        ("per turn", "right"),
    ):
        table.add_column(name, justify=justify, overflow="fold")
    rows = list(result.categories.items()) if len(result.categories) > 1 else []
    for i, (name, m) in enumerate(rows + [("all", result.overall)]):
        q = m.get("speedup_spread")
        table.add_row(
            name,
            str(m["turns"]),
            f"{m['acceptance_length']:.2f}",
            f"{m['spec_tokens_per_s']:.1f}",
            f"{m['target_tokens_per_s']:.1f}",
            f"{m['speedup']:.2f}x",
            f"{q['q1']:.2f}-{q['q3']:.2f}" if q else "-",
            style="bold" if name == "all" else None,
            end_section=i == len(rows) - 1,
        )
    console.print(table)
    if getattr(result, "depths", None):
        print_depths(result.depths, s.get("dtype", "its dtype"), greedy=s["temperature"] == 0)
    console.print(rule_text(s, getattr(result, "engine", "torch")), markup=False)
    rates = "  ".join(
        f"{j + 1}: {'-' if r is None else f'{r:.2f}'}"
        for j, r in enumerate(result.overall["acceptance_rate"])
    )
    console.print(
        f"acceptance rate by draft position (given the ones before were accepted): {rates}"
    )
    predicted = result.overall.get("predicted_acceptance")
    if predicted:
        pairs = "  ".join(
            f"{j + 1}: {p:.2f} vs {r:.2f}"
            for j, (p, r) in enumerate(zip(predicted, result.overall["acceptance_rate"]))
            if p is not None and r is not None
        )
        console.print(
            f"confidence head, predicted vs realised acceptance by position: {pairs}", markup=False
        )
    o = result.overall
    if o.get("draft_ms_per_cycle") is not None:
        console.print(
            f"drafting: {o['draft_ms_per_cycle']:.1f} ms per draft-verify cycle (catch-up + proposal), "
            f"{o['draft_share']:.0%} of the speculative decoding time",
            markup=False,
        )
    if s["temperature"] == 0:
        console.print(identity_text(o, s.get("dtype", "its dtype")), markup=False)
    text = spread_text(result.overall.get("speedup_spread"))
    if text:
        console.print(
            f"per-turn speed-up ('per turn' above: the middle half): {text}", markup=False
        )
    if s.get("threads"):
        repeats = s.get("timing_repeats", 1)
        timed = (
            "each turn timed once per decoder"
            if repeats == 1
            else f"each turn timed {repeats} times per decoder, alternating, median kept"
        )
        console.print(
            f"timing: {s['threads']} thread{'s' if s['threads'] != 1 else ''} "
            f"({s.get('threads_reason')}); {timed}",
            markup=False,
        )
    busy = getattr(result, "busy", None) or {}
    if busy.get("warning"):
        console.print(Text(f"WARNING: {busy['warning']}", style="bold yellow"))
    console.print(f"written: {result.json_path}, {result.plot_path}")


def fastest_depth(depths: dict[int, dict]) -> int:
    """The chain depth with the highest speed-up (the shorter one on a tie)."""
    return max(sorted(depths), key=lambda d: depths[d]["speedup"])


def print_depths(depths: dict[int, dict], dtype: str, greedy: bool = True) -> None:
    """--compare-depths: each chain's acceptance and speed-up over the same baseline, the fastest marked
    (identity with the target's output only under greedy: sampling draws other tokens)."""
    from rich.table import Table

    from spec_cli.console import console

    fastest = fastest_depth(depths)
    table = Table(
        title="chains of each depth, same turns, same target-alone timing", title_justify="left"
    )
    for name in ("depth", "accept len", "spec tok/s", "speed-up", "per turn", "same as target"):
        table.add_column(name, justify="right")
    for d, m in depths.items():
        q = m.get("speedup_spread")
        table.add_row(
            str(d),
            f"{m['acceptance_length']:.2f}",
            f"{m['spec_tokens_per_s']:.1f}",
            f"{m['speedup']:.2f}x",
            f"{q['q1']:.2f}-{q['q3']:.2f}" if q else "-",
            f"{m['same_as_target']}/{m['turns']}" if greedy else "-",
            style="bold" if d == fastest else None,
        )
    console.print(table)
    console.print(
        f"fastest here: a chain of {fastest} ({depths[fastest]['speedup']:.2f}x over the target "
        f"alone, {dtype}, this machine)",
        markup=False,
    )


def plot_acceptance(path: Path, overall: dict, categories: dict, title: str) -> Path:
    """acceptance.png: the acceptance rate at each draft position, overall (bars) and per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))

    def curve(m):  # positions never verified (None) are left out
        points = [(j + 1, r) for j, r in enumerate(m["acceptance_rate"]) if r is not None]
        return [j for j, _ in points], [r for _, r in points]

    positions = list(range(1, len(overall["acceptance_rate"]) + 1))
    ax.bar(*curve(overall), color="#4c72b0", alpha=0.6, label="all")
    for name, m in categories.items():
        ax.plot(*curve(m), "o-", ms=3, lw=1, label=name)
    ax.set_xlabel("draft position (tree: depth)")
    ax.set_ylabel("P(accepted | earlier positions accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(positions)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if categories:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
