"""The one place spec_cli reaches into vLLM's model runner: its classes' own attributes, not vLLM's API.

vLLM has two model runners. V1 (vllm/v1/worker/gpu_model_runner.py GPUModelRunner; the CPU build's
vllm/v1/worker/cpu_model_runner.py CPUModelRunner derives from it) keeps one persistent batch on the
runner. V2 (vllm/v1/worker/gpu/model_runner.py GPUModelRunner; vllm/v1/worker/cpu/model_runner.py on a
CPU) builds a new InputBatch (vllm/v1/worker/gpu/input_batch.py) every step and keeps it on no attribute
while the model's forward runs. vLLM 0.32 and 0.33 run V2 on a CUDA GPU for every method spec_cli starts
except P-EAGLE, and V1 on the CPU build (it has no Triton); vLLM 0.34 has only V2.

Each function here works on both runners and says which attribute it reads on each;
tests/engine/test_vllm_internals.py checks that the installed vLLM has them where these functions look.
Nothing here imports vLLM.
"""

from __future__ import annotations

from spec_cli.errors import ConfigError

V1_MODULE = "vllm.v1.worker.gpu_model_runner"  # V1's GPUModelRunner; V1 runners derive from it
V2_MODULE = "vllm.v1.worker.gpu.model_runner"  # V2's GPUModelRunner; V2 runners derive from it
_STEPS = "_spec_cli_steps"  # the runner attribute that holds a V2 runner's _Steps


def runner_kind(runner) -> str:
    """Which of vLLM's model runners this is: "V1" or "V2", from the module of its class or of the base it
    derives from (V1_MODULE, V2_MODULE); "" for neither."""
    for cls in type(runner).__mro__:
        if cls.__module__ == V1_MODULE:
            return "V1"
        if cls.__module__ == V2_MODULE:
            return "V2"
    return ""


def worker_runner(worker):
    """A worker's model runner: `worker.model_runner` (vllm/v1/worker/gpu_worker.py Worker; the CPU build's
    cpu_worker.py CPUWorker), on V1 and V2 alike."""
    return worker.model_runner


def model_runner(llm):
    """The model runner of an `LLM` whose engine runs in this process (the uni-process executor), None in
    another layout. The same chain on V1 and V2: `llm.llm_engine.engine_core` (v1/engine/core_client.py
    InprocClient) `.engine_core` (v1/engine/core.py EngineCore) `.model_executor` (v1/executor/
    uniproc_executor.py UniProcExecutor) `.driver_worker` (v1/worker/worker_base.py WorkerWrapperBase)
    `.worker`, then worker_runner."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return worker_runner(core.model_executor.driver_worker.worker)
    except AttributeError:
        return None


def target_model(runner):
    """The target's model module, whose forward the runner calls each step: `runner.get_model()` on V1
    (gpu_model_runner.py; cpu_model_runner.py: `runner.model`) and on V2 (gpu/model_runner.py:
    `runner.model`)."""
    return runner.get_model()


def runner_config(runner):
    """The VllmConfig the runner was built with: `runner.vllm_config`, set in __init__ on V1
    (gpu_model_runner.py) and V2 (gpu/model_runner.py)."""
    return runner.vllm_config


def draft_model(runner):
    """The draft's model module, None when the engine has none: `runner.get_draft_model()`, on V1
    (gpu_model_runner.py: `runner.drafter.model`, CUDA-graph wrappers unwrapped) and on V2
    (gpu/model_runner.py: `runner.speculator.model` when the speculator is a DraftModelSpeculator)."""
    get = getattr(runner, "get_draft_model", None)
    return None if get is None else get()


def drafter(runner):
    """The object whose `propose` drafts the tokens of each step, None without a draft: V1
    `runner.drafter` (gpu_model_runner.py; classes in v1/spec_decode/, e.g. llm_base_proposer.py), V2
    `runner.speculator` (gpu/model_runner.py; classes in v1/worker/gpu/spec_decode/)."""
    name = {"V1": "drafter", "V2": "speculator"}.get(runner_kind(runner))
    return getattr(runner, name, None) if name else None


def record_proposals(runner, keep) -> bool:
    """Call `keep(rows)` with the token ids the drafter proposes at each step (one list per request of the
    step), by wrapping its `propose`; False when the runner has no drafter. V1's propose returns the
    proposals [num_reqs, k] (some proposers: a tuple that starts with them); V2's returns a view of its
    own buffer [num_reqs, k] that the runner then masks past the step's k in place, so it is read here,
    before that."""
    owner = drafter(runner)
    if owner is None:
        return False
    propose = owner.propose

    def recording(*args, **kwargs):
        out = propose(*args, **kwargs)
        ids = out[0] if isinstance(out, tuple) else out
        try:
            rows = ids.tolist()
        except Exception:  # noqa: BLE001 (not a tensor: nothing to record)
            return out
        keep(rows)
        return out

    owner.propose = recording
    return True


class _Steps:
    """The InputBatch of the step a V2 runner is running (None in a dummy step): its `prepare_inputs`,
    which `execute_model` calls before the model's forward, returns it."""

    def __init__(self, runner):
        self.batch = None
        prepare, execute = runner.prepare_inputs, runner.execute_model

        def preparing(*args, **kwargs):
            self.batch = prepare(*args, **kwargs)
            return self.batch

        def executing(*args, **kwargs):
            self.batch = None  # a dummy step (profile, warm-up) builds InputBatch.make_dummy, not through here
            return execute(*args, **kwargs)

        runner.prepare_inputs, runner.execute_model = preparing, executing


def follow_steps(runner) -> None:
    """Make step_requests answer inside the model's forward, from now on. V2: wrap the runner's
    `prepare_inputs` and `execute_model` (gpu/model_runner.py) once, to keep each step's InputBatch.
    V1 keeps its batch on the runner: nothing to do."""
    kind = runner_kind(runner)
    if kind == "V2" and _STEPS not in vars(runner):
        setattr(runner, _STEPS, _Steps(runner))
    elif not kind:
        raise ConfigError(
            f"vLLM's model runner {type(runner).__module__}.{type(runner).__name__} is neither its "
            "V1 nor its V2 runner, whose batches spec_cli reads",
            "use --target-engine transformers; or report it with your vLLM version",
        )


def step_requests(runner) -> list[tuple[str, int, int]]:
    """(request id, start, end) of each request of the step whose forward runs now: its tokens are
    [start, end) of the forward's flattened tokens. Requests come in the runner's order for this step,
    so name them by id.
    V1 (gpu_model_runner.py): `runner.input_batch.req_ids` and `.num_reqs` (v1/worker/gpu_input_batch.py,
    the persistent batch) and `runner.query_start_loc.cpu` (a CpuGpuBuffer).
    V2: `req_ids`, `num_reqs` and `query_start_loc_np` of the InputBatch follow_steps kept
    (v1/worker/gpu/input_batch.py); V2 sorts a step's requests its own way (decode, then extend, then
    prefill: gpu/model_runner.py sort_batch_req_ids). A dummy step has none."""
    if runner_kind(runner) == "V2":
        steps = vars(runner).get(_STEPS)
        if steps is None:
            raise RuntimeError(
                "call vllm_runner.follow_steps(runner) before the runner's first step"
            )
        return batch_requests(steps.batch) if steps.batch is not None else []
    num_reqs = runner.input_batch.num_reqs
    offsets = runner.query_start_loc.cpu[: num_reqs + 1].tolist()  # token offsets per request
    return list(zip(runner.input_batch.req_ids[:num_reqs], offsets, offsets[1:]))


def batch_requests(batch) -> list[tuple[str, int, int]]:
    """(request id, start, end) of each request of a V2 InputBatch (v1/worker/gpu/input_batch.py: `req_ids`
    in batch order, `num_reqs` without the padding rows, `query_start_loc_np` [num_reqs_after_padding + 1])."""
    num_reqs = int(batch.num_reqs)
    offsets = [int(o) for o in batch.query_start_loc_np[: num_reqs + 1]]
    return list(zip(batch.req_ids[:num_reqs], offsets, offsets[1:]))
