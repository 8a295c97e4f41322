"""How long `spec demo` will take on THIS machine: measured before the first stage, not assumed.

CPUs differ by more than 2x on the demo (a core with a native bf16 path runs the target and the
training step in bf16; one with AVX2 only runs fp32), so a fixed figure in the help is wrong on one of
them. Given its profile's work (greedy answers to fixed prompts, a number of training steps), the
time is that work over this machine's speed at each kind of step:

- regenerate: answer tokens over batched decoding (the target, the stage's dtype, 16 rows);
- precompute: training tokens over the target's prefill (with the stage's per-token overhead);
- train: steps x batch tokens over a training step of the demo's draft at the trainer's precision;
- eval: decoded tokens (target alone, then with the draft) over one-row decoding at eval's dtype.

Each is timed for a few steps (about 15 seconds in all on 2 cores). The per-profile work was counted
on the demo's own data; how much longer each stage takes than its kind of step alone (`OVERHEAD`) and
the fixed costs were fitted on whole demo runs (see the constants). `size` and `steps_for` turn it
around for `spec demo --minutes`: the work that fits a number of minutes on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from spec_cli.stages.tune import BATCH_SPEED_POWER
from spec_cli.targets import loading

# counted on the demo's data (machine-independent): answer tokens regenerate writes per sample (7,810
# for the quick profile's 48 samples), tokens per training conversation after templating (31,948 for 148)
ANSWER_TOKENS_PER_SAMPLE = 163
TOKENS_PER_CONVERSATION = 216
SUPERVISED_SHARE = (
    0.68  # of a training conversation's tokens, its answers' (the default demo's cache: 0.680)
)
# each stage's time over what its measured kind of step predicts, fitted on whole quick demos on 2 AMD
# EPYC cores (one run capped to AVX2: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2; one in bf16):
# regenerate 1.0 min (vLLM, start-up included) / 2.1x in transformers, precompute 1.2 min (the head's
# top-k and writing beside the prefill), the two evals 2.0 min (prompts' prefill, the target alone and
# with the draft, loading). Train: fitted on 2 Intel Xeon cores with AMX (the default demo's 1,000 steps
# took 744 s where the calibration step, conversations packed as the demo's, ran 3,380 tokens/s: 1.23x)
# and on the same cores capped to AVX2 (1,150 tokens/s in the loop against 1,414 calibrated, evals and
# checkpoints every 50 steps: ~1.28x); the cache's reading beside the step is most of it. Not refitted
# on the EPYC cores (its old factor, 0.62, went with a calibration step that scored every slot); the
# demo states its total again once training has run 50 steps (stages/demo/__init__.py TrainPace).
# The evals: EVAL_LOAD_SECONDS (loading, the prompts' prefill), then their tokens at the one-row speed
# (OVERHEAD "eval"): the default demo sized to 30 minutes on 2 AMD EPYC cores with AVX2 only (2026-12-07:
# MT-bench 163 s for 3,072 tokens at 17.4 tokens/s, held-out 130 s for 2,048), where the quick demos'
# 2.0 (mostly loading) had put them at 352 and 235 s.
OVERHEAD = {
    "regenerate/vllm": 0.45,
    "regenerate/transformers": 2.1,
    "precompute": 1.15,
    "train": 1.25,
    "eval": 1.0,
    "one-pass cache": 0.5,
}
EVAL_LOAD_SECONDS = 15.0
# vLLM in regenerate: its engine's start (VLLM_REGEN_START_SECONDS), then its answers at 0.45x the seconds
# the one-engine batched decode predicts (vLLM batches far more rows than the clock's 16). Between the two
# CPU classes measured: 0.35x on 2 Intel Xeon cores with AMX (1,100 answers in 384 s with the clock at 208
# tokens/s), 0.63x on 2 AMD EPYC cores with AVX2 only (328 answers in 354 s, the clock at 134.5); the demo
# sizes its steps again once regenerate has run, so its error moves the steps, not the end. One pass (regenerate --features): the cache's positions the generation did not compute, the
# full-vocabulary statistics and the writing, 0.5x the prefill's seconds over the rows' tokens (1,100 rows,
# 257k tokens: 78 s of cache and 31 s of kept rows beside a prefill of about 1,200 tokens/s).
VLLM_REGEN_START_SECONDS = 30.0
FIXED_SECONDS = 40.0  # assets, vocab map, the export and its checks (measured: 0.4-0.6 min)
# The engine in the training loop decodes beside the training step on the same cores. Fitted on the
# default demo on 2 Intel Xeon cores with AMX (docs/serving.md): training ran at 0.76x its tokens/s while
# an evaluation decoded (median of the log records with engine_busy >= 0.9 against <= 0.1), and an
# evaluation's decoding took 1.7x its tokens at the clock's one-row speed (vLLM on one thread, beside
# training): 1.7 x 0.24 = 0.4 of those seconds are added to the stage. The closing `spec tune`: its
# engines' loading and the check of the recommended config (TUNE_FIXED_SECONDS), then its decoding, whose
# tokens/s at batch b is the one-row decode's times b ** TUNE_BATCH_POWER (spec tune's own forecast),
# TUNE_OVERHEAD times that (1.3x on the AMX demo: 247 s against 189 s; 0.83x on the AVX2 EPYC demo: 259 s
# against 75 + 223 s; between them).
ENGINE_SLOWDOWN = 0.4
TUNE_FIXED_SECONDS = {"vllm": 75.0, "torch": 5.0}
TUNE_BATCH_POWER = BATCH_SPEED_POWER
TUNE_OVERHEAD = 1.05
# spec eval --engine vllm: two engines loaded, then the turns at VLLM_EVAL_FACTOR x the one-row speed's
# seconds (the default demo: AMX cores 1.5 min, the engines 0.5 of it, about 0.8x; AVX2 EPYC 109 s, 0.67x)
VLLM_EVAL_FIXED_SECONDS = 30.0
VLLM_EVAL_FACTOR = 0.75
TUNE_BATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Speeds:
    """Tokens per second on this machine."""

    batched_decode: float  # regenerate's kind: 16 rows at a time, KV cache
    prefill: float  # precompute's kind: 512-token rows
    decode: float  # eval's kind: one row, one token at a time
    train: float  # the demo's draft, its batch_tokens packed, at the trainer's precision

    def text(self) -> str:
        return (
            f"target {self.batched_decode:.0f} tok/s batched, {self.decode:.0f} tok/s alone, prefill "
            f"{self.prefill:.0f} tok/s; draft training {self.train:.0f} tok/s"
        )


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def target_speeds(
    target_dir: Path, device: torch.device, dtype: torch.dtype, only_decode: bool = False
) -> tuple[float, float, float]:
    """(batched decode, prefill, one-row decode) tokens/s of the target at `dtype` (only_decode: the
    last alone; the others 0)."""
    from transformers import DynamicCache

    model = loading.load_model(target_dir, device, dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    cache_arg = loading.cache_argument(model)

    def decode(rows: int, steps: int = 4) -> float:
        prompt = torch.randint(0, vocab, (rows, 64), generator=gen).to(device)
        cache = DynamicCache(config=model.config)  # filled in place by each forward
        model(input_ids=prompt, use_cache=True, **{cache_arg: cache})
        token = prompt[:, -1:]
        t0 = time.perf_counter()
        for _ in range(steps):
            model(input_ids=token, use_cache=True, **{cache_arg: cache})
        return rows * steps / (time.perf_counter() - t0)

    decode(1, 2)  # warm-up
    single = decode(1)
    if only_decode:
        return 0.0, 0.0, single
    batched = decode(16)
    rows = torch.randint(0, vocab, (2, 512), generator=gen).to(device)
    prefill = rows.numel() / _best(lambda: model(input_ids=rows), 1)
    return batched, prefill, single


def train_speed(
    target_dir: Path,
    device: torch.device,
    draft_vocab_size: int,
    batch_tokens: int,
    ttt_steps: int,
    precision: str = "auto",
    data_dtype: torch.dtype = torch.float32,
) -> float:
    """Tokens/s of the demo's EAGLE-3 draft trained as `spec train` steps it (forward, backward, AdamW)
    on one row of `batch_tokens` random supervision laid out as the demo's rows are: conversations of
    TOKENS_PER_CONVERSATION packed back to back, the last SUPERVISED_SHARE of each (its answers) scored.
    The head's cost follows the scored slots and the attention's the documents, and how much each weighs
    differs by CPU (a matrix unit makes the head cheap), so the layout is the data's, not a full row's.
    Each step also reads its batch from the feature cache, which rebuilds the target's distribution over
    the draft vocab from the stored final states (`data_dtype`, as precompute stores them) with the
    target's head: timed too and added (the reader and the step share the cores)."""
    from spec_cli.batch import TargetBatch
    from spec_cli.draft.config import DraftConfig
    from spec_cli.draft.eagle3.model import Eagle3Draft
    from spec_cli.draft.eagle3.ttt import ttt_forward
    from spec_cli.draft.step import forward_backward, make_optimizer, optimizer_step
    from spec_cli.train_options import OptimOptions
    from spec_cli.trainer.device import autocast, step_precision

    config = loading.load_config(target_dir)
    layers = config.num_hidden_layers
    aux = [
        min(i, layers - 1) for i in (1, layers // 2, layers - 3)
    ]  # three states: only their count costs
    draft_config = DraftConfig.from_target(config, draft_vocab_size, aux, fc_norm=True)
    gen = torch.Generator().manual_seed(0)
    draft = Eagle3Draft(draft_config)
    draft.set_vocab_map(
        torch.sort(torch.randperm(draft_config.vocab_size, generator=gen)[:draft_vocab_size]).values
    )
    draft.to(device)
    T, Vd = batch_tokens, draft_vocab_size
    lengths = [TOKENS_PER_CONVERSATION] * (T // TOKENS_PER_CONVERSATION)
    lengths += [T - sum(lengths)] if T > sum(lengths) else []
    mask = torch.zeros(1, T, dtype=torch.long)
    positions = torch.zeros(1, T, dtype=torch.long)
    start = 0
    for n in lengths:
        mask[0, start + n - max(1, round(n * SUPERVISED_SHARE)) : start + n - 1] = (
            1  # answers; not the last
        )
        positions[0, start : start + n] = torch.arange(n)
        start += n
    batch = TargetBatch(
        aux_hidden=torch.randn(1, T, 3 * draft_config.target_hidden_size, generator=gen),
        input_ids=torch.randint(0, draft_config.vocab_size, (1, T), generator=gen),
        attention_mask=torch.ones(1, T, dtype=torch.long),
        loss_mask=mask,
        target_p=torch.randn(1, T, Vd, generator=gen).softmax(-1),
        position_mask=mask.bool(),
        target_ids=torch.randint(0, draft_config.vocab_size, (1, T), generator=gen),
        target_mass=torch.ones(1, T),
        position_ids=positions,
        seq_lens=torch.tensor([lengths]),
    ).to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, OptimOptions(lr=1e-4))
    step_autocast = autocast(device, step_precision(precision, device))

    def step():
        forward_backward(
            SimpleNamespace(plan=lambda b: [None]),
            lambda b, unit: ttt_forward(draft, b, ttt_steps=ttt_steps),
            batch,
            1,
            step_autocast,
        )
        optimizer_step(params, optimizer, 0.5)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    from spec_cli.targets.supervision import draft_distribution, selected_logits

    hidden = torch.randn(1, T, config.hidden_size, generator=gen).to(device, data_dtype)
    head = (torch.randn(Vd, config.hidden_size, generator=gen) / config.hidden_size**0.5).to(
        device, data_dtype
    )
    lse = torch.zeros(1, T, device=device)

    def decode():
        draft_distribution(selected_logits(hidden, head), lse)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return T / (_best(step, 1) + _best(decode, 2))


def measure(
    target_dir: Path,
    device: torch.device,
    data_dtype: torch.dtype,
    eval_dtype: torch.dtype,
    draft_vocab_size: int,
    batch_tokens: int,
    ttt_steps: int,
) -> Speeds:
    batched, prefill, single = target_speeds(target_dir, device, data_dtype)
    if eval_dtype != data_dtype:
        single = target_speeds(target_dir, device, eval_dtype, only_decode=True)[2]
    return Speeds(
        batched,
        prefill,
        single,
        train_speed(
            target_dir, device, draft_vocab_size, batch_tokens, ttt_steps, data_dtype=data_dtype
        ),
    )


@torch.no_grad()
def chains_compared(target_dir: Path, device: torch.device, dtype: torch.dtype, depth: int) -> int:
    """How many shorter chains `spec eval --compare-depths auto` will decode beside a chain of `depth` on
    this machine: its own rule (stages/eval.cheaper_depths) on the target's forward times over 1 ..
    depth + 1 tokens, measured as it measures them."""
    from spec_cli.eval.speculative import verify_costs
    from spec_cli.eval.target import Target
    from spec_cli.stages.eval import cheaper_depths

    model = loading.load_model(target_dir, device, dtype)
    prompt = torch.randint(
        0,
        model.get_input_embeddings().weight.shape[0],
        (64,),
        generator=torch.Generator().manual_seed(0),
    ).tolist()
    target = Target(model, [])
    try:
        return len(
            cheaper_depths(
                verify_costs(target, prompt, list(range(1, depth + 2)), repeats=3), depth
            )
        )
    finally:
        target.close()


def engine_steps(profile) -> list[int]:
    """The training steps after which the engine in the loop evaluates: every engine_every, and the
    last."""
    return [*range(profile.engine_every, profile.steps, profile.engine_every), profile.steps]


def engine_seconds(profile, speeds: Speeds) -> float:
    """What one evaluation of the engine in the loop adds to the train stage: it decodes its prompts'
    both turns twice (the draft, the target alone) beside the training step, on the same cores."""
    tokens = profile.engine_prompts * 2 * profile.engine_tokens * 2
    return tokens / speeds.decode * ENGINE_SLOWDOWN


def stage_seconds(
    profile,
    speeds: Speeds,
    engine: str = "transformers",
    compared: int | None = None,
    eval_engine: str = "torch",
) -> dict[str, float]:
    """The profile's stages on a machine of these speeds (seconds); engine: what regenerates; compared:
    the shorter chains the MT-bench eval decodes too (default: the profile's list, or none for auto);
    eval_engine: what decodes in the training loop and in the closing tune."""
    conversations = profile.samples + profile.original_samples
    # tokens each eval decodes: both turns, the target alone and the draft's chain (MT-bench: and the
    # chains of the depths it compares)
    if compared is None:
        listed = profile.eval_compare_depths
        compared = 0 if isinstance(listed, str) else len(set(listed) - {profile.eval_depth})
    passes = 2 + compared
    eval_tokens = profile.eval_prompts * 2 * profile.eval_max_new_tokens * passes
    heldout_tokens = profile.heldout_prompts * 2 * profile.eval_max_new_tokens * 2
    if (
        eval_engine == "vllm"
    ):  # the target alone and k = 0 .. max_k at each batch size, `requests` prompts
        configs, rate = profile.tune_max_k + 2, lambda b: speeds.decode * b**TUNE_BATCH_POWER  # noqa: E731
        tune_seconds = sum(
            configs * max(profile.tune_requests, b) * profile.tune_tokens / rate(b)
            for b in getattr(profile, "tune_batch_sizes", TUNE_BATCH_SIZES)
        )
    else:  # batch 1: the target alone, chains 1 .. max_k and two trees per depth from 2
        configs = 1 + profile.tune_max_k + 2 * max(0, profile.tune_max_k - 1)
        tune_seconds = configs * profile.tune_requests * profile.tune_tokens / speeds.decode
    regenerate = (
        profile.samples
        * ANSWER_TOKENS_PER_SAMPLE
        / speeds.batched_decode
        * OVERHEAD[f"regenerate/{engine}"]
    )
    precompute = conversations * TOKENS_PER_CONVERSATION / speeds.prefill
    if engine == "vllm":
        regenerate += VLLM_REGEN_START_SECONDS
    one_pass = getattr(profile, "one_pass", False)
    if one_pass:  # regenerate writes the cache as it answers
        regenerate += precompute * OVERHEAD["one-pass cache"]
    return {
        "regenerate": regenerate,
        "precompute": 0.0 if one_pass else precompute * OVERHEAD["precompute"],
        "train": profile.steps * profile.batch_tokens / speeds.train * OVERHEAD["train"]
        + len(engine_steps(profile)) * engine_seconds(profile, speeds),
        "eval": EVAL_LOAD_SECONDS + eval_tokens / speeds.decode * OVERHEAD["eval"],
        "eval-heldout": EVAL_LOAD_SECONDS + heldout_tokens / speeds.decode * OVERHEAD["eval"],
        "tune": TUNE_FIXED_SECONDS[eval_engine]
        + profile.tune_repeats * tune_seconds * TUNE_OVERHEAD,
        # MT-bench again in vLLM (its two engines' loading, then the target alone and the chain)
        **(
            {
                "eval-vllm": VLLM_EVAL_FIXED_SECONDS
                + profile.eval_prompts
                * 2
                * profile.eval_max_new_tokens
                * 2
                / speeds.decode
                * VLLM_EVAL_FACTOR
            }
            if eval_engine == "vllm"
            else {}
        ),
        "fixed": FIXED_SECONDS,
    }


# ----------------------------------------------------------------------------- sizing to minutes
# `spec demo --minutes M` buys the most acceptance M minutes allow on this machine: the stages whose work
# is fixed (the evals, the export, the tune, the engine's start) come first, and the minutes left are split
# between the target's answers (regenerate) and training steps. The split keeps the training at PASSES
# passes over the answers' tokens. docs/recipe.md ("Sizing the demo to its minutes") derives it from the
# measured runs: at 1,000 steps, 2.5 passes over 7.6x the target's answers gave +0.12 MT-bench / +0.18
# held-out over 8 passes of the smaller data, for about as many minutes as 1,000 more steps on the
# smaller data bought (+0.10 / +0.09); with the larger data, steps then paid again (+0.20 / +0.20 from 2.5
# to 5 passes). Eight passes (the earlier default) overfit (training top-1 0.79 against 0.51 held out).
PASSES = 4.0
MAX_PASSES = 8.0  # steps sized again after the data stages stop here (a fast machine: a GPU)
MIN_ANSWERS = 200  # below these the demo is the smoke test's size: --quick is that
MIN_STEPS = 100
MAX_ANSWERS = (
    8000  # the built-in ShareGPT's usable prompts, with room after them for the held-out chats
)
ENGINE_EVALUATIONS = (
    4  # the engine in the loop answers this often over the run (and at the last step)
)


def passes_steps(profile, answers: int, passes: float) -> int:
    """Steps of the profile's batch that make `passes` passes over `answers` answered conversations
    (a multiple of 10, at least MIN_STEPS)."""
    tokens = passes * answers * TOKENS_PER_CONVERSATION
    return max(MIN_STEPS, round(tokens / profile.batch_tokens / 10) * 10)


def sized(profile, answers: int, steps: int | None = None):
    """The profile with `answers` of the target's answers (none as written) and `steps` steps (default:
    PASSES passes over the answers' tokens), the engine in the loop ENGINE_EVALUATIONS times."""
    from dataclasses import replace

    if steps is None:
        steps = passes_steps(profile, answers, PASSES)
    every = max(50, round(steps / ENGINE_EVALUATIONS / 50) * 50)
    changes = dict(samples=answers, original_samples=0, steps=steps, engine_every=every, sized=True)
    if getattr(profile, "one_pass", False):
        changes["one_pass_samples"] = answers
    return replace(profile, **changes)


def _largest(seconds, lo: int, hi: int, budget: float) -> int:
    """The largest n in [lo, hi] with seconds(n) <= budget, by bisection (seconds grows with n); lo - 1
    when none fits."""
    if seconds(lo) > budget:
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if seconds(mid) <= budget else (lo, mid - 1)
    return lo


def demo_seconds(profile, speeds: Speeds, engine: str, compared, eval_engine: str) -> float:
    return sum(stage_seconds(profile, speeds, engine, compared, eval_engine).values())


def size(profile, speeds: Speeds, seconds: float, engine: str, compared, eval_engine: str):
    """The profile sized so that its stages take `seconds` on a machine of `speeds`: the most answers
    (and PASSES passes of steps over them) that fit. Raises ValueError with the smallest demo's seconds
    when even MIN_ANSWERS and MIN_STEPS do not fit."""

    def total(answers: int) -> float:
        return demo_seconds(sized(profile, answers), speeds, engine, compared, eval_engine)

    answers = _largest(total, MIN_ANSWERS, MAX_ANSWERS, seconds)
    if answers < MIN_ANSWERS:
        raise ValueError(total(MIN_ANSWERS))
    return sized(profile, answers)


def steps_for(profile, speeds: Speeds, seconds: float, eval_engine: str, compared) -> int:
    """The most training steps (at least MIN_STEPS, at most MAX_PASSES passes over the answers) whose
    training and the stages after it take `seconds` on a machine of `speeds`: the demo's steps sized
    again once its data is made."""
    after = ("train", "eval", "eval-vllm", "eval-heldout", "tune", "fixed")

    def total(steps: int) -> float:
        parts = stage_seconds(
            sized(profile, profile.samples, steps), speeds, "vllm", compared, eval_engine
        )
        return sum(parts[n] for n in after if n in parts)

    most = passes_steps(profile, profile.samples, MAX_PASSES)
    return max(MIN_STEPS, _largest(total, MIN_STEPS, most, seconds))
