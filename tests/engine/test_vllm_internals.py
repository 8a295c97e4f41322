"""What spec_cli reads of vLLM's model runners (spec_cli/engine/vllm_runner.py) is where the installed vLLM
keeps it: each attribute and method those functions read, in the runner they read it on (V1:
v1/worker/gpu_model_runner.py and the CPU build's cpu_model_runner.py; V2: v1/worker/gpu/model_runner.py
and its InputBatch). Methods and dataclass fields are checked on the imported classes; attributes that
only instances get (`self.x = ...`) in the class's source. A vLLM that moves one fails here by name, not
midway through a capture or a reload. No engine starts: the V2 runner needs Triton, which the CPU build
lacks, so its step rows are checked on runners of vLLM's own classes, not started, against rows worked
out from each request's tokens."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip(
    "vllm", reason="vLLM is not installed (the `vllm` extra): no runner internals to check"
)

from spec_cli.engine import vllm_runner  # noqa: E402
from spec_cli.errors import ConfigError  # noqa: E402
from spec_cli.targets.vllm_worker import step_rows  # noqa: E402

V1, V1_CPU = "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner"
V2, V2_CPU = "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.cpu.model_runner"
V2_BATCH = "vllm.v1.worker.gpu.input_batch"

# (module, class, attribute an instance gets in the class's own code): what vllm_runner reads on instances
SET_ON_INSTANCES = [
    ("vllm.entrypoints.llm", "LLM", "llm_engine"),  # model_runner
    ("vllm.v1.engine.llm_engine", "LLMEngine", "engine_core"),
    ("vllm.v1.engine.core_client", "InprocClient", "engine_core"),
    ("vllm.v1.engine.core", "EngineCore", "model_executor"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor", "driver_worker"),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "worker"),
    ("vllm.v1.worker.gpu_worker", "Worker", "model_runner"),  # worker_runner
    ("vllm.v1.worker.cpu_worker", "CPUWorker", "model_runner"),
    (V1, "GPUModelRunner", "input_batch"),  # step_requests, V1
    (V1, "GPUModelRunner", "query_start_loc"),
    ("vllm.v1.utils", "CpuGpuBuffer", "cpu"),
    (V1, "GPUModelRunner", "drafter"),  # drafter, V1
    (V1, "GPUModelRunner", "vllm_config"),  # runner_config
    (V1, "GPUModelRunner", "model"),  # target_model (get_model returns it)
    (V2, "GPUModelRunner", "speculator"),  # drafter, V2
    (V2, "GPUModelRunner", "vllm_config"),
    (V2, "GPUModelRunner", "model"),
    (
        "vllm.v1.worker.gpu.spec_decode.speculator",
        "DraftModelSpeculator",
        "model",
    ),  # draft_model, V2
]

# (module, class, method or property the class has, its own or inherited)
METHODS = [
    (V1, "GPUModelRunner", "get_model"),
    (V1, "GPUModelRunner", "get_draft_model"),
    (V1_CPU, "CPUModelRunner", "get_model"),
    (V1_CPU, "CPUModelRunner", "get_draft_model"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "req_ids"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "num_reqs"),
    ("vllm.v1.spec_decode.eagle", "EagleProposer", "propose"),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer", "propose"),
    (V2, "GPUModelRunner", "prepare_inputs"),
    (V2, "GPUModelRunner", "execute_model"),
    (V2, "GPUModelRunner", "get_model"),
    (V2, "GPUModelRunner", "get_draft_model"),
    (V2_CPU, "CPUModelRunner", "prepare_inputs"),
    (V2_CPU, "CPUModelRunner", "execute_model"),
    (V2_CPU, "CPUModelRunner", "get_draft_model"),
    ("vllm.v1.worker.gpu.spec_decode.eagle.speculator", "EagleSpeculator", "propose"),
    ("vllm.v1.worker.gpu.spec_decode.dflash.speculator", "DFlashSpeculator", "propose"),
    ("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator", "propose"),
]


def _cls(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _class_node(module: str, name: str) -> ast.ClassDef:
    path = Path(importlib.util.find_spec(module).origin)
    found = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ClassDef) and n.name == name
    ]
    assert found, f"vLLM's {path} defines no class {name}"
    return found[0]


def _set_on_self(node: ast.ClassDef) -> set[str]:
    """The attributes the class's methods assign on `self` (plain, annotated or tuple assignments)."""
    names = set()
    for sub in ast.walk(node):
        targets = (
            sub.targets
            if isinstance(sub, ast.Assign)
            else [sub.target]
            if isinstance(sub, ast.AnnAssign)
            else []
        )
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    names.add(t.attr)
    return names


@pytest.mark.parametrize(
    "module, name, attribute", SET_ON_INSTANCES, ids=[f"{c}.{a}" for _, c, a in SET_ON_INSTANCES]
)
def test_each_instance_attribute_the_boundary_reads_is_set_by_its_class(module, name, attribute):
    assert attribute in _set_on_self(_class_node(module, name)), (
        f"vLLM's {module}.{name} no longer sets self.{attribute}, which spec_cli/engine/vllm_runner.py reads"
    )


@pytest.mark.parametrize(
    "module, name, method", METHODS, ids=[f"{m.rsplit('.', 2)[-2]}.{c}.{a}" for m, c, a in METHODS]
)
def test_each_method_the_boundary_calls_is_on_its_class(module, name, method):
    assert hasattr(_cls(module, name), method), (
        f"vLLM's {module}.{name} has no {method}, which spec_cli/engine/vllm_runner.py uses"
    )


def test_the_v2_batch_fields_and_where_the_runner_builds_the_batch():
    """The InputBatch fields batch_requests reads, prepare_inputs returning it, and execute_model calling
    self.prepare_inputs (looked up on the instance, where follow_steps wraps it) before self.model's forward."""
    fields = {f.name for f in dataclasses.fields(_cls(V2_BATCH, "InputBatch"))}
    assert {"req_ids", "num_reqs", "query_start_loc_np"} <= fields
    runner = _cls(V2, "GPUModelRunner")
    assert inspect.signature(runner.prepare_inputs).return_annotation in (
        "InputBatch",
        _cls(V2_BATCH, "InputBatch"),
    )
    execute = next(
        n
        for n in _class_node(V2, "GPUModelRunner").body
        if isinstance(n, ast.FunctionDef) and n.name == "execute_model"
    )
    calls = {}
    for node in ast.walk(execute):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            calls.setdefault(node.func.attr, node.lineno)
    assert "prepare_inputs" in calls, "V2's execute_model no longer calls self.prepare_inputs"
    forward = next(
        (
            n.lineno
            for n in ast.walk(execute)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "model"
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "self"
        ),
        None,
    )
    assert forward is not None and calls["prepare_inputs"] < forward


def test_the_proposer_and_reload_signatures():
    """V2's propose takes the step's InputBatch first; vLLM's in-place reload takes what reload_draft passes."""
    propose = inspect.signature(
        _cls("vllm.v1.worker.gpu.spec_decode.speculator", "BaseSpeculator").propose
    )
    assert list(propose.parameters)[1] == "input_batch"
    reload = inspect.signature(
        _cls("vllm.model_executor.model_loader.reload.inplace", "reload_weights")
    )
    assert list(reload.parameters)[:2] == ["vllm_config", "model"]
    assert {"weights_iterator", "weights_path", "is_checkpoint_format"} <= set(reload.parameters)


def test_runner_kind_of_vllms_own_runner_classes():
    kinds = {
        m: vllm_runner.runner_kind(object.__new__(_cls(m, n)))
        for m, n in [
            (V1, "GPUModelRunner"),
            (V1_CPU, "CPUModelRunner"),
            (V2, "GPUModelRunner"),
            (V2_CPU, "CPUModelRunner"),
        ]
    }
    assert kinds == {V1: "V1", V1_CPU: "V1", V2: "V2", V2_CPU: "V2"}
    assert vllm_runner.V1_MODULE == V1 and vllm_runner.V2_MODULE == V2
    with pytest.raises(ConfigError, match="is neither its V1 nor its V2 runner"):
        vllm_runner.follow_steps(SimpleNamespace())


# ----------------------------------------------------------------------------- V2 step rows


def _batch(requests: list[tuple[str, int, int]], padding: int = 0):
    """vLLM's own InputBatch for one step: requests (id, tokens computed before, tokens this step) in
    the step's order, `padding` extra rows and tokens past them (as CUDA-graph padding adds)."""
    cls = _cls(V2_BATCH, "InputBatch")
    counts = [n for _, _, n in requests] + [0] * padding
    fields = {
        f.name: None
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return cls(
        **{
            **fields,
            "req_ids": [r for r, _, _ in requests],
            "num_reqs": len(requests),
            "num_reqs_after_padding": len(requests) + padding,
            "query_start_loc_np": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            "num_computed_tokens_np": np.array([c for _, c, _ in requests], dtype=np.int32),
        }
    )


TAG = {"a": 1, "b": 2, "c": 3, "d": 4}


def _inputs(requests, padding_tokens: int):
    """The forward's positions and states for a step: each token's state is TAG[its request] * 1000 +
    its position, aux i adds i / 10."""
    positions = torch.cat(
        [torch.arange(c, c + n) for _, c, n in requests] + [torch.zeros(padding_tokens).long()]
    )
    tags = torch.cat(
        [torch.full((n,), TAG[r]) for r, _, n in requests] + [torch.zeros(padding_tokens).long()]
    )
    hidden = (tags * 1000 + positions).double()[:, None]  # [N, 1]
    return positions, hidden, [hidden + 0.1, hidden + 0.2]


@pytest.fixture(scope="module")
def fake_v2():
    """A runner of vLLM's V2 class whose execute_model does what V2's does around the forward: a real step
    calls self.prepare_inputs (returning its InputBatch) and then self.model(positions=...); a dummy step
    builds its batch elsewhere. Its model keeps the rows step_rows gives (aux in order [1, 0])."""

    class Runner(_cls(V2_CPU, "CPUModelRunner")):
        def __init__(self):  # vLLM's own __init__ builds a device state: not needed to read a batch
            self.rows = []

            def forward(*, positions):
                _, hidden, aux = self.inputs
                self.rows.extend(step_rows(self, (), {"positions": positions}, hidden, aux, [1, 0]))

            self.model = forward

        def prepare_inputs(self, step):
            return step["batch"]

        def execute_model(self, step):
            if not step.get("dummy"):
                self.prepare_inputs(step)
            self.inputs = step["inputs"]
            self.model(positions=step["inputs"][0])

    runner = Runner()
    vllm_runner.follow_steps(runner)
    vllm_runner.follow_steps(runner)  # once per runner: a second call wraps nothing again
    return runner


def _expected(requests) -> dict:
    """What each request's tokens are, worked out from its own numbers: {id: (positions, hidden, aux)}."""
    out = {}
    for rid, computed, n in requests:
        pos = torch.arange(computed, computed + n)
        h = (TAG[rid] * 1000 + pos).double()[:, None]
        out[rid] = (pos, h, torch.cat([h + 0.2, h + 0.1], dim=-1))
    return out


def _run(runner, requests, padding=0, padding_tokens=0, dummy=False) -> dict:
    runner.rows = []
    runner.execute_model(
        {
            "batch": _batch(requests, padding),
            "inputs": _inputs(requests, padding_tokens),
            "dummy": dummy,
        }
    )
    assert len({rid for rid, *_ in runner.rows}) == len(runner.rows)
    return {rid: (pos, h, a) for rid, pos, h, a in runner.rows}


def test_v2_rows_are_each_request_s_tokens_of_the_step_running(fake_v2):
    # V2 orders a step's requests its own way (decodes first, then extends, then prefills), not by arrival
    steps = [
        [("c", 7, 1), ("a", 0, 5), ("b", 0, 3)],
        [("b", 3, 1), ("c", 8, 1), ("a", 5, 2), ("d", 0, 4)],
    ]
    for requests in steps:
        got = _run(fake_v2, requests, padding=2, padding_tokens=3)
        want = _expected(requests)
        assert set(got) == set(want)  # the padding rows give none
        for rid, (pos, h, a) in want.items():
            assert (
                torch.equal(got[rid][0], pos)
                and torch.equal(got[rid][1], h)
                and torch.equal(got[rid][2], a)
            )
    assert (
        _run(fake_v2, steps[0], dummy=True) == {}
    )  # a dummy step (profile, warm-up): no request's rows


def test_v2_step_requests_need_follow_steps():
    runner = object.__new__(_cls(V2, "GPUModelRunner"))
    with pytest.raises(RuntimeError, match="follow_steps"):
        vllm_runner.step_requests(runner)


def test_v1_rows_read_the_persistent_batch():
    runner = object.__new__(_cls(V1_CPU, "CPUModelRunner"))
    runner.input_batch = SimpleNamespace(num_reqs=2, req_ids=["x", "y", None])
    runner.query_start_loc = SimpleNamespace(cpu=torch.tensor([0, 3, 4, 4], dtype=torch.int32))
    vllm_runner.follow_steps(runner)  # nothing to do on V1
    assert vllm_runner.step_requests(runner) == [("x", 0, 3), ("y", 3, 4)]


# ----------------------------------------------------------------------------- draft and proposals


def test_the_draft_model_and_the_proposals_on_each_runner():
    """draft_model through vLLM's own get_draft_model; the proposals as propose returned them, though V2
    masks its buffer in place right after (dynamic k)."""
    module = torch.nn.Linear(2, 2)
    v1 = object.__new__(_cls(V1_CPU, "CPUModelRunner"))
    v2 = object.__new__(_cls(V2, "GPUModelRunner"))
    speculator = object.__new__(
        _cls("vllm.v1.worker.gpu.spec_decode.eagle.speculator", "EagleSpeculator")
    )
    buffer = torch.tensor([[5, 6, 7], [8, 9, 10]])
    speculator.model, speculator.propose = module, lambda *args, **kwargs: buffer[:2]
    v2.speculator = speculator
    v1.drafter = SimpleNamespace(
        model=module, propose=lambda *args, **kwargs: (buffer[:1].clone(), None)
    )
    assert vllm_runner.draft_model(v1) is module and vllm_runner.draft_model(v2) is module
    v2.speculator = None
    assert vllm_runner.draft_model(v2) is None and vllm_runner.record_proposals(v2, print) is False
    v2.speculator = speculator
    kept = []
    assert vllm_runner.record_proposals(v1, kept.extend) and vllm_runner.record_proposals(
        v2, kept.extend
    )
    v1.drafter.propose()
    v2.speculator.propose()
    buffer[:, 1:] = -1  # what V2's runner does to the drafts past the step's k
    assert kept == [[5, 6, 7], [5, 6, 7], [8, 9, 10]]
