"""The target loaded once, drafts decoded against it one after another.

`spec eval` opens a session for its one draft; `spec train --eval-engine` keeps one open for the whole
run (in its own process, spec_cli/stages/engine_worker.py) and hands it every evaluated checkpoint's
export. Two engines behind one shape, `decoders(draft, settings) -> (spec, base)`:

- `TorchSession`: spec_cli's decoder (chain or EAGLE-2 tree) and the target alone with its KV cache, in
  PyTorch; a new draft is a new module over the same target.
- `VllmSession`: two vLLM engines in this process, the target with the draft (a chain of `depth`) and
  the target alone; a new draft of the same run is loaded into the running engine with vLLM's own
  in-place reload (Engine.reload_draft), so the engines start once.

Each says how it drafted and accepted (`decoding_rule(settings)`, speculative.decoding_rule's names):
spec_cli's from its settings, vLLM's from the speculative config its engine runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_cli.draft import algorithms
from spec_cli.draft.algorithm import INPUT_EMBEDS
from spec_cli.errors import ConfigError
from spec_cli.eval.speculative import (
    Settings,
    decoding_rule,
    generate,
    generate_target,
    verify_costs,
)
from spec_cli.eval.target import Target
from spec_cli.targets import loading


class TorchSession:
    """The target in PyTorch on `device` in `dtype`; each draft is decoded through the same `Target`."""

    name = "torch"

    def __init__(self, target_dir: Path, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.model = loading.load_model(target_dir, device, dtype)
        self.target: Target | None = None  # made with the first draft (the aux layers it reads)
        self.reads: tuple | None = None

    @property
    def info(self) -> dict:
        return {"name": "torch", "version": torch.__version__}

    def decoders(self, loaded, settings: Settings):
        """(spec, base) for a drafts.LoadedDraft: each `(prompt ids, seed or None[, settings])` -> a
        Generation. Every draft of one session reads the same target layers."""
        draft = loaded.model
        if loaded.needs_embeddings:  # engines share the target's table with the draft
            draft.copy_embeddings(self.model.get_input_embeddings().weight.float().cpu())
        if (
            loaded.needs_head
        ):  # EAGLE-1/2 proposes through the target's lm_head (the engines share it)
            draft.copy_head(self.model.get_output_embeddings().weight.float().cpu())
        draft.to(device=self.device, dtype=self.dtype).eval()
        algorithm = algorithms.get(draft.config.algorithm)
        if hasattr(
            draft, "use_target_embeddings"
        ):  # MSD: drafted tokens go through the target's embedding
            draft.use_target_embeddings(self.model.get_input_embeddings())
        reads = (
            tuple(draft.config.aux_layer_ids),
            algorithm.final_hidden,
            INPUT_EMBEDS in algorithm.needs,
        )
        if self.target is None:
            self.target = Target(
                self.model,
                draft.config.aux_layer_ids,
                final_hidden=algorithm.final_hidden,
                input_embeds=INPUT_EMBEDS in algorithm.needs,
            )
            self.reads = reads
        elif reads != self.reads:
            raise ConfigError(
                f"this draft reads target layers {list(reads[0])}; the session's target was set up "
                f"for {list(self.reads[0])}",
                "evaluate drafts of one run in one session",
            )
        target = self.target

        def generator(seed: int | None):
            return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

        def spec(ids, seed, s=settings):
            return generate(target, draft, ids, s, generator(seed))

        def base(ids, seed, s=settings):
            return generate_target(target, ids, s, generator(seed))

        return spec, base

    def verify_costs(self, ids, sizes):
        return verify_costs(self.target, ids, sizes)

    def decoding_rule(self, settings: Settings) -> dict:
        return decoding_rule(settings)

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
            self.target = None


class VllmSession:
    """The target alone and the target with a draft, each a vLLM engine in this process. The draft
    engine starts with the first draft folder (its loading watched: `load_problems`); later folders of
    the same draft are reloaded into it."""

    name = "vllm"

    def __init__(
        self,
        target_dir: Path,
        dtype: torch.dtype,
        depth: int,
        algorithm_name: str,
        seed: int = 0,
        max_model_len: int | None = None,
        memory: float | None = None,
    ):
        """memory: on a GPU, the share of it each engine may take (vLLM's gpu_memory_utilization);
        None: vLLM's default split between the two engines the session holds."""
        from spec_cli.engine import vllm

        self.vllm = vllm
        self.target_dir, self.dtype, self.depth, self.seed = Path(target_dir), dtype, depth, seed
        self.algorithm = algorithms.get(algorithm_name)
        self.length = max_model_len or loading.max_positions(loading.load_config(target_dir))
        self.memory = memory if memory is not None else vllm.shared_gpu(2)
        self.spec_engine = self.base_engine = None
        self.load_problems: list[str] = []
        self.folder: Path | None = None

    @property
    def info(self) -> dict:
        return {
            "name": "vllm",
            "version": self.vllm.version(),
            "draft_folder": str(self.folder),
            "load_problems": self.load_problems,
            **(self.spec_engine.sample_methods() if self.spec_engine is not None else {}),
        }

    def decoders(self, folder: Path, settings: Settings):
        """(spec, base) for the draft in the vLLM export `folder`."""
        if self.spec_engine is None:
            from spec_cli.export.readme import export_model_impl

            fmt = self.algorithm.engine_format("vllm")
            options = dict(fmt.engine_options)
            if settings.draft_sampling == "sampled":  # vLLM's default drafts the argmax ("greedy")
                options["draft_sample_method"] = "probabilistic"
            try:
                # an export written with --allow-unsupported-target: served through vLLM's Transformers backend
                # (the target alone below stays on its native class, as a server without the draft runs it)
                self.spec_engine = self.vllm.Engine(
                    self.target_dir,
                    folder,
                    self.depth,
                    self.dtype,
                    self.length,
                    self.seed,
                    track_loading=True,
                    method=fmt.method,
                    draft_class=self.algorithm.vllm_draft_class,
                    speculative_options=options,
                    gpu_memory_utilization=self.memory,
                    seeded=settings.temperature > 0,
                    model_impl=export_model_impl(folder),
                )
                self.load_problems = self.spec_engine.load_report.problems()
                self.base_engine = self.vllm.Engine(
                    self.target_dir,
                    None,
                    dtype=self.dtype,
                    max_model_len=self.length,
                    seed=self.seed,
                    gpu_memory_utilization=self.memory,
                    seeded=settings.temperature > 0,
                )
            except BaseException:  # both or neither: a later draft starts them again
                self.close()
                raise
        else:
            self.spec_engine.reload_draft(folder)
        self.folder = Path(folder)
        spec_engine, base_engine = self.spec_engine, self.base_engine

        def spec(ids, seed, s=settings):
            return spec_engine.generate(ids, s.max_new_tokens, s.temperature, s.eos_ids, seed)

        def base(ids, seed, s=settings):
            return base_engine.generate(ids, s.max_new_tokens, s.temperature, s.eos_ids, seed)

        return spec, base

    def decoding_rule(self, settings: Settings) -> dict:
        """The rule the draft engine runs, read from its speculative config (not from what was asked)."""
        return vllm_rule(settings.temperature, self.spec_engine.sample_methods())

    def close(self) -> None:
        for engine in (self.spec_engine, self.base_engine):
            if engine is not None:
                engine.close()
        self.spec_engine = self.base_engine = None


def vllm_rule(temperature: float, methods: dict) -> dict:
    """vLLM's draft_sample_method and rejection_sample_method in speculative.decoding_rule's names. Its
    rejection sampler (vllm/v1/sample/rejection_sampler.py) accepts a draft token when p/q >= u, with
    q = 1 when the drafter passes no probabilities (the argmax drafts of "greedy"); at temperature 0 it
    accepts while the token is the target's argmax."""
    draft, rejection = methods["draft_sample_method"], methods["rejection_sample_method"]
    if temperature == 0:
        return {"draft_sampling": "greedy", "acceptance_rule": "target-argmax"}
    if rejection != "standard":  # synthetic or block verification: not a rule spec_cli runs
        return {"draft_sampling": draft, "acceptance_rule": f"vllm-{rejection}"}
    if draft == "probabilistic":
        return {"draft_sampling": "sampled", "acceptance_rule": "prob-ratio"}
    return {"draft_sampling": "greedy", "acceptance_rule": "target-prob"}
