"""The export checked by the engine itself: vLLM loads the written folder, decodes a few short greedy
prompts with it, and its acceptance counts are compared with spec_cli's PyTorch evaluator running the
CHECKPOINT (its weights rounded to the export dtype, i.e. what the files should hold) on the same prompts.
It runs eval's decoder, so it lives here and `spec export` (stages/export.py) calls it: export/ imports
nothing from eval/.

Why the checkpoint and not the files: a zeroed d2t or shifted aux ids in the folder would make both
readers of the folder agree, and serve badly. vLLM's load itself is checked too (`LoadReport`): a draft
parameter vLLM left unloaded or a file key it dropped fails the export.

Tolerance. Both sides decode greedily in fp32; the target's and the draft's kernels differ (vLLM's
CPU linears are oneDNN, spec_cli's are PyTorch's), so an argmax can flip where the top two logits
nearly tie, and the rest of that answer then differs. A flip moves a few steps, not the acceptance
length of every prompt: the check fails when the acceptance lengths differ by more than
max(ABS_TOLERANCE, REL_TOLERANCE * the reference's).

Proposals. Acceptance alone says little about a draft that accepts little (a briefly trained one):
reading the wrong target layers then changes what it proposes, not how often that is accepted. So the
tokens vLLM's drafter proposes at each verify step are recorded too and, for prompts whose outputs are
identical on both sides (so every step has the same context), compared with the checkpoint's: the
check fails when fewer than MIN_DRAFTS_EQUAL of the steps propose exactly the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec_cli.draft import algorithms
from spec_cli.errors import ArtifactError, ConfigError, ExportCheckError, listing
from spec_cli.eval import prompts
from spec_cli.eval.report import Tally
from spec_cli.eval.speculative import Settings, eos_ids, generate
from spec_cli.eval.target import Target
from spec_cli.export.source import DraftSource
from spec_cli.targets import loading

MODES = ("auto", "vllm", "none")
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is, in two sentences.",
    "Give three tips for someone learning to cook.",
    "What is 17 times 23? Show your steps.",
)
MAX_NEW_TOKENS = 32
DEPTH = (
    3  # draft tokens per verification when the export does not say (its README's serving command)
)
ABS_TOLERANCE = 0.05
REL_TOLERANCE = 0.05
MIN_DRAFTS_EQUAL = (
    0.9  # proposals compared step by step: a near-tie flip changes one, wrong layers most
)


@dataclass
class EngineCheckReport:
    engine: str
    version: str
    prompts: int
    acceptance_length: float  # vLLM
    reference_acceptance_length: float  # spec_cli's decoder on the checkpoint
    accepted: list[int]  # per draft position, vLLM
    reference_accepted: list[int]
    same_tokens: int  # prompts whose vLLM output equals the reference's token for token
    drafts_compared: int = (
        0  # verify steps whose proposals were compared (prompts with equal outputs)
    )
    drafts_equal: float = 0.0  # share of those where vLLM proposed exactly the checkpoint's tokens
    shared: list[str] = field(default_factory=list)  # draft weights vLLM takes from the target
    model_impl: str | None = (
        None  # vLLM's --model-impl the target ran under (None: its native class)
    )


def resolve_mode(mode: str | None, fmt, title: str = "") -> str:
    """auto -> vllm when vLLM is installed and reads this format (an ExportFormat), else none. An installed
    vLLM release that serves the format nowhere is refused, unless none (the export is for another vLLM).
    `title`: the algorithm's, for the message."""
    import os

    from spec_cli.engine import vllm

    mode = (mode or os.environ.get("SPEC_ENGINE_CHECK") or "auto").lower()
    if mode not in MODES:
        raise ConfigError(
            f"--engine-check {mode!r} is not one of {', '.join(MODES)}", "e.g. --engine-check vllm"
        )
    if mode == "vllm" and fmt.engine != "vllm":
        raise ConfigError(
            f"vLLM does not read the {fmt.name} format, so it cannot check this export",
            f"use --engine-check none for {fmt.name} exports",
        )
    if (
        mode != "none" and fmt.engine == "vllm" and vllm.unserved(fmt)
    ):  # the installed release, on any machine
        raise ConfigError(
            f"the installed vLLM cannot serve {title + ' drafts' if title else 'this export'}: "
            f"{vllm.unserved(fmt)}",
            "or pass --engine-check none to write the export for a vLLM that serves it",
        )
    if mode == "vllm" and vllm.cannot_run(fmt):
        raise ConfigError(
            f"no engine check for {fmt.method} exports here: {vllm.cannot_run(fmt)}",
            "--engine-check none writes the export with the self-check (vLLM's reading rules); "
            "run the engine check on a GPU machine",
        )
    if mode == "auto":
        return (
            "vllm"
            if fmt.engine == "vllm" and vllm.available() and not vllm.cannot_run(fmt)
            else "none"
        )
    return mode


def refuse_unservable(target_config) -> None:
    """Refuse, in vLLM's words, a target whose vLLM model class cannot feed a draft that reads aux states (EAGLE-3, P-EAGLE)."""
    from spec_cli.engine import vllm

    arch = (getattr(target_config, "architectures", None) or [""])[0]
    ok, why = vllm.target_supports_eagle3(arch)
    if not ok and "cannot be asked here" in why:  # the engine serves it, but not in this install
        raise ArtifactError(
            f"the vLLM engine check cannot load this target here: {why}",
            "--engine-check none writes the export with the checks that need no engine (the "
            "engine's own loader and the predictions); or run the engine check where vLLM "
            "imports its class (a vLLM install with its torchvision)",
        )
    if not ok:
        raise ArtifactError(
            f"vLLM cannot serve a draft that reads aux states (EAGLE-3, P-EAGLE) for this target: {why}",
            "export for another engine (--format sglang), or --engine-check none to write it "
            "anyway",
        )


def reference_draft(src: DraftSource, dtype: torch.dtype):
    """The checkpoint's draft with its float weights rounded to the export dtype (what the files hold)."""
    draft = algorithms.get(src.config.algorithm).build(src.config)
    state = {k: (v.to(dtype).float() if v.is_floating_point() else v) for k, v in src.state.items()}
    draft.load_state_dict(state)
    return draft.eval()


def check_prompts(tokenizer) -> list[list[int]]:
    conversations = [
        prompts.Conversation(id=str(i), turns=[text]) for i, text in enumerate(PROMPTS)
    ]
    return [prompts.prompt_ids(tokenizer, conv, 0) for conv in conversations]


@dataclass
class Reference:
    """spec_cli's decoder on the checkpoint over the check's prompts: what vLLM's outputs are compared
    with. One reference serves every folder written from the same checkpoint (another format, a copy)."""

    ids: list[list[int]]  # the prompts' token ids
    settings: Settings
    outputs: list  # generate()'s results, one per prompt


def reference_decode(
    src: DraftSource, dtype: torch.dtype, target_dir: Path, depth: int = DEPTH
) -> Reference:
    """The checkpoint's draft (rounded to `dtype`) decoding the check's prompts greedily in fp32 beside
    the target. Run it before any vLLM engine is built in this process: an engine lowers the process's
    torch threads for good."""
    algorithm = algorithms.get(src.config.algorithm)
    tokenizer = loading.load_tokenizer(target_dir)
    ids = check_prompts(tokenizer)
    settings = Settings(
        depth=depth,
        topk=1,
        num_tokens=depth,
        temperature=0.0,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_ids=eos_ids(tokenizer, loading.generation_config(target_dir)),
    )
    model = loading.load_model(target_dir, torch.device("cpu"), torch.float32)
    draft = reference_draft(src, dtype)
    draft.copy_embeddings(model.get_input_embeddings().weight.float())
    target = Target(model, src.config.aux_layer_ids, final_hidden=algorithm.final_hidden)
    try:
        outputs = [generate(target, draft, p, settings) for p in ids]
    finally:
        target.close()
    return Reference(ids, settings, outputs)


def engine_check(
    folder: Path,
    fmt: str,
    src: DraftSource,
    dtype: torch.dtype,
    target_dir: Path,
    depth: int = DEPTH,
    model_impl: str | None = None,
    reference: Reference | None = None,
) -> EngineCheckReport:
    """Raise ExportCheckError when vLLM serves `folder` differently from the checkpoint; else report.
    model_impl "transformers": the target through vLLM's Transformers backend (a target whose native class
    cannot capture aux states, exported with --allow-unsupported-target). reference: reference_decode's
    for this checkpoint, dtype and depth (decoded here when not given)."""
    from spec_cli.engine import vllm

    vllm.require("the export's engine check (--engine-check vllm)")
    config = loading.load_config(target_dir)
    algorithm = algorithms.get(src.config.algorithm)
    if (
        algorithm.aux_layers and not model_impl
    ):  # a draft that reads no aux state (EAGLE-1/2) runs beside any target
        refuse_unservable(config)
    if reference is None:
        reference = reference_decode(src, dtype, target_dir, depth)
    elif reference.settings.depth != depth:
        raise ValueError(
            f"the reference decoded {reference.settings.depth} draft tokens, not {depth}"
        )
    ids, settings = reference.ids, reference.settings

    length = max(len(p) for p in ids) + MAX_NEW_TOKENS + depth + 8
    served_as = algorithm.format(fmt)  # vLLM's speculative method and options for this format
    with vllm.Engine(
        target_dir,
        folder,
        depth,
        torch.float32,
        length,
        track_loading=True,
        method=served_as.method,
        speculative_options=dict(served_as.engine_options),
        draft_class=algorithm.vllm_draft_class,
        model_impl=model_impl,
    ) as engine:
        served = [engine.generate(p, MAX_NEW_TOKENS, 0.0, settings.eos_ids) for p in ids]
        load = engine.load_report

    ours, theirs = Tally(depth), Tally(depth)
    for r, s in zip(reference.outputs, served):
        ours.add(r, None)
        theirs.add(s, None)
    o, t = ours.metrics(), theirs.metrics()
    report = EngineCheckReport(
        engine="vllm",
        version=vllm.version() or "",
        prompts=len(ids),
        acceptance_length=t["acceptance_length"],
        reference_acceptance_length=o["acceptance_length"],
        accepted=t["accepted"],
        reference_accepted=o["accepted"],
        same_tokens=sum(r.tokens == s.tokens for r, s in zip(reference.outputs, served)),
        shared=list(load.shared),
        model_impl=model_impl,
    )
    pairs = [
        (a, b)
        for r, s in zip(reference.outputs, served)
        if r.tokens == s.tokens and s.drafts
        for a, b in zip(r.drafts, s.drafts)
    ]
    report.drafts_compared = len(pairs)
    report.drafts_equal = sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0
    problems = load.problems()
    if pairs and report.drafts_equal < MIN_DRAFTS_EQUAL:
        problems.append(
            f"vLLM proposed the checkpoint's draft tokens at only {report.drafts_equal:.0%} of "
            f"{len(pairs)} verify steps (same context on both sides)"
        )
    gap = abs(report.acceptance_length - report.reference_acceptance_length)
    if gap > max(ABS_TOLERANCE, REL_TOLERANCE * report.reference_acceptance_length):
        problems.append(
            f"vLLM accepts {report.acceptance_length:.2f} tokens per step (accepted per position "
            f"{report.accepted}) where the checkpoint accepts "
            f"{report.reference_acceptance_length:.2f} ({report.reference_accepted}) on the "
            f"same {len(ids)} greedy prompts"
        )
    if problems:
        raise ExportCheckError(
            f"vLLM {report.version} does not serve the {fmt} export as trained: "
            + listing(problems),
            "nothing was written to the output folder; --engine-check none skips this "
            "check (SPEC_DEBUG=1 shows vLLM's log)",
        )
    return report
